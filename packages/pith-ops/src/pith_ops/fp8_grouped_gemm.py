"""FP8 grouped GEMM: y[rows of e] = x[rows of e] @ w[e] with e4m3 operands (pith_ops.fp8_quant).

Shape legend: N grouped rows, I input features, O output features, E experts (groups).

As pith_ops.fp8_linear, one weight scale per expert, x8c and dy8c requantised over each expert's
rows. On CUDA (torch._scaled_grouped_mm) every group end must be a multiple of GROUP_ALIGN, or the
wgrad's CUTLASS asserts on the device (checking it: a host sync).
"""

import torch
from torch import Tensor

from pith_ops._common import FLOAT_DTYPES, INDEX_DTYPES, check, eager_or_custom
from pith_ops.fp8_linear import _backward, _rows_op, _weight, _weight_fake, fp8_linear_weight
from pith_ops.fp8_linear import backward as _linear_backward
from pith_ops.fp8_quant import (
    FP8,
    cols_from_rows,
    cols_from_rows_reference,
    dequantize_cols,
    dequantize_rows,
    quantize_rows,
    quantize_rows_reference,
    quantize_weight_reference,
)
from pith_ops.grouped_gemm import _zero_tail, grouped_gemm_reference

GROUP_ALIGN = 16  # every group end's multiple on CUDA (moe_permute's align)


def _gmm(a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor, ends: Tensor) -> Tensor:
    """Grouped (a_q * a_scale) @ (b_q * b_scale) in bf16, b column-major: a [M, K] (rows in groups, scale
    [M]) with b [E, K, N] (scale [E, N]) -> [M, N]; or a [M, Kt] with b [Kt, N], the contraction in
    groups (scales [E*M], [E*N]) -> [E, M, N]. On CPU: a loop, in fp32."""
    if a_q.is_cuda:
        y = torch._scaled_grouped_mm(
            a_q, b_q, a_scale, b_scale, offs=ends, out_dtype=torch.bfloat16, use_fast_accum=True
        )
        return _zero_tail(y, ends) if b_q.ndim == 3 else y
    E, M, N = ends.shape[0], a_q.shape[0], b_q.shape[-1]
    y = torch.zeros((M, N) if b_q.ndim == 3 else (E, M, N), dtype=torch.float32)
    start = 0
    for e, end in enumerate(ends.tolist()):
        if b_q.ndim == 3:
            y[start:end] = (a_q[start:end].float() * a_scale[start:end, None]) @ (b_q[e].float() * b_scale[e])
        else:
            a = a_q[:, start:end].float() * a_scale[e * M : (e + 1) * M, None]
            y[e] = a @ (b_q[start:end].float() * b_scale[e * N : (e + 1) * N])
        start = max(start, end)
    return y.bfloat16()


def dgrad(dy8_NO: Tensor, dy8_scale_N: Tensor, w8_EIO: Tensor, w8_scale_EI: Tensor, ends: Tensor) -> Tensor:
    """dx_NI = dy[rows of e] @ w[e].T."""
    return _gmm(dy8_NO, dy8_scale_N, w8_EIO.transpose(1, 2), w8_scale_EI, ends)


def wgrad(dy8_NO: Tensor, dy8_scale_N: Tensor, x8_NI: Tensor, x8_scale_N: Tensor, ends: Tensor) -> Tensor:
    """dw_EIO[e] = x[rows of e].T @ dy[rows of e] (bf16)."""
    x8c_IN, x8c_scale_EI = cols_from_rows(x8_NI, x8_scale_N, ends)
    dy8c_ON, dy8c_scale_EO = cols_from_rows(dy8_NO, dy8_scale_N, ends)
    # CUTLASS wants the contracted N a multiple of 16 too: both operands widened to their storage
    # (empty_cols pads rows to 16), which the group ends never reach.
    width = (x8c_IN.shape[1] + 15) // 16 * 16
    a, b = (q.as_strided((q.shape[0], width), q.stride()) for q in (x8c_IN, dy8c_ON))
    return _gmm(a, x8c_scale_EI.flatten(), b.t(), dy8c_scale_EO.flatten(), ends)


def _forward(
    x_NI: Tensor, w_EIO: Tensor, w8_EIO: Tensor, w8_scale_EI: Tensor, w8t_EOI: Tensor, w8t_scale_EO: Tensor,
    ends: Tensor, x8_NI: Tensor | None = None, x8_scale_N: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """w_EIO is not read, nor x when x8 is given. -> (y, the x8 made or empties)."""
    made = quantize_rows(x_NI) if x8_NI is None else (x_NI.new_empty(0, dtype=FP8), x_NI.new_empty(0))
    x8 = made if x8_NI is None else (x8_NI, x8_scale_N)
    return _gmm(*x8, w8t_EOI.transpose(1, 2), w8t_scale_EO, ends).to(x_NI.dtype), *made


_op = torch.library.custom_op("pith::fp8_grouped_gemm", _forward, mutates_args=())
_weight_op = torch.library.custom_op("pith::fp8_grouped_gemm_weight", _weight, mutates_args=())
_weight_op.register_fake(_weight_fake)
_dgrad_op = torch.library.custom_op("pith::fp8_grouped_gemm_dgrad", dgrad, mutates_args=())
_wgrad_op = torch.library.custom_op("pith::fp8_grouped_gemm_wgrad", wgrad, mutates_args=())


@_dgrad_op.register_fake
def _(dy8_NO, dy8_scale_N, w8_EIO, w8_scale_EI, ends):
    return dy8_NO.new_empty(dy8_NO.shape[0], w8_EIO.shape[1], dtype=torch.bfloat16)


@_wgrad_op.register_fake
def _(dy8_NO, dy8_scale_N, x8_NI, x8_scale_N, ends):
    return dy8_NO.new_empty(ends.shape[0], x8_NI.shape[1], dy8_NO.shape[1], dtype=torch.bfloat16)


@_op.register_fake
def _(x_NI, w_EIO, w8_EIO, w8_scale_EI, w8t_EOI, w8t_scale_EO, ends, x8_NI=None, x8_scale_N=None):
    N, O = x_NI.shape[0], w_EIO.shape[2]
    n = N if x8_NI is None else 0
    return (
        x_NI.new_empty(N, O),
        x_NI.new_empty(n, x_NI.shape[1], dtype=FP8),
        x_NI.new_empty(n, dtype=torch.float32),
    )


def _setup(ctx, inputs, output):
    _, *made = output
    ctx.mark_non_differentiable(*made)
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the fp8 outputs
    x8 = made if len(inputs) < 8 or inputs[7] is None else inputs[7:9]
    ctx.save_for_backward(*x8, *inputs[2:4], inputs[6])
    ctx.dtypes = inputs[0].dtype, inputs[1].dtype


def backward(saved, dy_NO: Tensor, need_dx: bool, x_dtype: torch.dtype, ops=(quantize_rows, dgrad, wgrad)):
    """fp8_linear.backward; saved: (x8_NI, x8_scale_N, w8_EIO, w8_scale_EI, ends)."""
    return _linear_backward(saved, dy_NO, need_dx, x_dtype, ops)


_fp8_grouped_gemm = eager_or_custom(
    _op, _setup, _forward, _backward, (_rows_op, _dgrad_op, _wgrad_op), (quantize_rows, dgrad, wgrad)
)


def fp8_grouped_gemm_weight(w_EIO: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return fp8_linear_weight(w_EIO, _weight_op)


def forward(
    x_NI: Tensor, w_EIO: Tensor, group_ends_E: Tensor, w8=None, x8=(None, None)
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """fp8_grouped_gemm's forward without autograd, for a caller running `backward`: -> (y, saved)."""
    w8 = fp8_grouped_gemm_weight(w_EIO) if w8 is None else w8
    ends = group_ends_E.to(torch.int32).contiguous()
    y, *made = _forward(x_NI if x8[0] is not None else x_NI.contiguous(), w_EIO, *w8[:4], ends, *x8)
    return y, (*(made if x8[0] is None else x8), *w8[:2], ends)


def fp8_grouped_gemm(x_NI: Tensor, w_EIO: Tensor, group_ends_E: Tensor, w8=None, x8=(None, None)) -> Tensor:
    """grouped_gemm through FP8 GEMMs, in x's dtype. w8: as fp8_linear's. x8: quantize_rows(x) made by
    the pass that wrote x (swiglu_fp8, FP8Rows), or Nones. On CUDA I, O and the group ends must be
    multiples of 16."""
    check("x_NI", x_NI, ndim=2, dtypes=FLOAT_DTYPES, contiguous=x8[0] is None)
    check("w_EIO", w_EIO, ndim=3, dtypes=FLOAT_DTYPES, device=x_NI.device, contiguous=w8 is None)
    check("group_ends_E", group_ends_E, ndim=1, dtypes=INDEX_DTYPES, device=x_NI.device)
    E, I, O = w_EIO.shape
    if x_NI.shape[1] != I or group_ends_E.shape[0] != E:
        raise ValueError(
            f"expected w_EIO [E, {x_NI.shape[1]}, O] (x_NI's columns) and one group end per expert, "
            f"got w_EIO {tuple(w_EIO.shape)} and {group_ends_E.shape[0]} ends"
        )
    if x_NI.is_cuda and (I % 16 or O % 16):
        raise ValueError(f"fp8_grouped_gemm on CUDA needs I and O multiples of 16, got {I} and {O}")
    w8 = fp8_grouped_gemm_weight(w_EIO) if w8 is None else w8
    return _fp8_grouped_gemm(x_NI, w_EIO, *w8[:4], group_ends_E.to(torch.int32).contiguous(), *x8)[0]


def fp8_grouped_gemm_reference(
    x_NI: Tensor, w_EIO: Tensor, group_ends_E: Tensor, dy_NO: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The module docstring's GEMMs in float64, dequantised: -> (y, dx, dw)."""
    ends = group_ends_E.to(torch.int32)
    q, scale_EI, _, _ = quantize_weight_reference(w_EIO)
    w8 = q.double() * scale_EI.double()[..., None]
    x8, dy8 = quantize_rows_reference(x_NI), quantize_rows_reference(dy_NO)
    y = grouped_gemm_reference(dequantize_rows(*x8), w8, ends)
    dx = grouped_gemm_reference(dequantize_rows(*dy8), w8.mT, ends)
    x8c_IN = dequantize_cols(*cols_from_rows_reference(*x8, ends), ends)
    dy8c_ON = dequantize_cols(*cols_from_rows_reference(*dy8, ends), ends)
    starts = [0, *ends[:-1].tolist()]
    dw = torch.stack([x8c_IN[:, s:t] @ dy8c_ON[:, s:t].T for s, t in zip(starts, ends.tolist())])
    return y, dx, dw
