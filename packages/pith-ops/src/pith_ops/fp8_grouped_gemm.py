"""FP8 grouped GEMM: y[rows of e] = x[rows of e] @ w[e] with e4m3 operands scaled per row / column.

Shape legend: N grouped rows, I input features, O output features, E experts (groups).

As pith_ops.fp8_linear, each GEMM's operands are quantised along the contracted axis (pith_ops.fp8_quant):
- forward  y  = x8 @ w8[e]                  x8: x by rows (over I); w8: w[e] by columns (over I), [E, O, I];
- dgrad    dx = dy8 @ w8r[e].T              dy8: dy by rows (over O); w8r: w[e] by rows (over O), [E, I, O];
- wgrad    dw[e] = x8c[e].T @ dy8c[e]       x, dy by columns over each expert's rows, stored transposed.
The forward keeps x8c (fp8) and w8r for the backward. w8 and w8r come from
`fp8_grouped_gemm_weight(w)`, a function of w alone (a caller may compute it once for several calls);
`forward` and `backward` are the op without autograd, its backward in two halves (dx now, dw later). On
CUDA the GEMMs are torch._scaled_grouped_mm (CUTLASS) with fast accumulation; on CPU (where torch
has no grouped FP8 GEMM) a loop over the experts multiplies the dequantised operands in fp32.
On CUDA every group end must be a multiple of GROUP_ALIGN = 16 (moe_permute(..., align=16)): the
wgrad contracts over each group's rows, and the FP8 kernel wants 16-byte multiples there (measured:
a device-side assert otherwise; checking the ends here would cost a host sync). Rows past
group_ends[-1] give zeros.
"""

import functools

import torch
from torch import Tensor

from pith_ops._common import FLOAT_DTYPES, INDEX_DTYPES, check, eager_or_custom
from pith_ops.cast import _cast_back
from pith_ops.fp8_quant import (
    dequantize_cols,
    dequantize_rows,
    empty_cols,
    quantize_cols,
    quantize_cols_reference,
    quantize_rows,
    quantize_rows_reference,
)
from pith_ops.grouped_gemm import _zero_tail, grouped_gemm_reference

GROUP_ALIGN = 16  # rows: what every group end must be a multiple of on CUDA (moe_permute's align)


def _gmm(a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor, ends: Tensor) -> Tensor:
    """Grouped (a_q * a_scale) @ (b_q * b_scale) in bf16, b column-major. 2-D a [M, K] (rows in groups,
    scale [M]) with 3-D b [E, K, N] (scale [E, N]) -> [M, N]; or 2-D a [M, Kt] with 2-D b [Kt, N], the
    contraction in groups (scales [E*M], [E*N]) -> [E, M, N]."""
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


def dgrad(dy_NO: Tensor, w8r_EIO: Tensor, w8r_scale_EI: Tensor, ends: Tensor) -> Tensor:
    """dx_NI = dy[rows of e] @ w[e].T through the row-quantised weight the forward kept."""
    dy8, dy8_scale = quantize_rows(dy_NO)
    return _gmm(dy8, dy8_scale, w8r_EIO.transpose(1, 2), w8r_scale_EI, ends)


def wgrad(dy_NO: Tensor, x8c_IN: Tensor, x8c_scale_EI: Tensor, ends: Tensor) -> Tensor:
    """dw_EIO[e] = x[rows of e].T @ dy[rows of e] through the column-quantised input the forward kept."""
    dy8c_ON, dy8c_scale_EO = quantize_cols(dy_NO, ends)
    # CUTLASS wants the contracted size N a multiple of 16 too: both operands widened to their storage
    # (empty_cols pads rows to 16); the group ends never reach the padding, so it is never read.
    width = (x8c_IN.shape[1] + 15) // 16 * 16
    a, b = (q.as_strided((q.shape[0], width), q.stride()) for q in (x8c_IN, dy8c_ON))
    return _gmm(a, x8c_scale_EI.flatten(), b.t(), dy8c_scale_EO.flatten(), ends)


def quantize_weight(w_EIO: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (w8c_EOI, w8c_scale_EO: w[e] by columns over I, the forward's operand; w8r_EIO, w8r_scale_EI:
    w[e] by rows over O, dgrad's). A function of w alone (pith_engine.layers caches it per step)."""
    E, I, O = w_EIO.shape
    w8c_EOI, w8c_scale = quantize_cols(w_EIO)
    w8r, w8r_scale = quantize_rows(w_EIO.view(E * I, O))
    return w8c_EOI, w8c_scale[:, 0], w8r.view(E, I, O), w8r_scale.view(E, I)


def _forward(
    x_NI: Tensor, w_EIO: Tensor, w8c_EOI: Tensor, w8c_scale_EO: Tensor, w8r_EIO: Tensor,
    w8r_scale_EI: Tensor, ends: Tensor, x8_NI: Tensor | None = None, x8_scale_N: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """w_EIO is not read (quantize_weight's outputs are): it is the input the weight gradient is for.
    x8_NI, x8_scale_N: quantize_rows(x) when the pass writing x made them (pith_ops.swiglu_fp8)."""
    x8 = quantize_rows(x_NI) if x8_NI is None else (x8_NI, x8_scale_N)
    y_NO = _gmm(*x8, w8c_EOI.transpose(1, 2), w8c_scale_EO, ends).to(x_NI.dtype)
    x8c_IN, x8c_scale_EI = quantize_cols(x_NI, ends)
    return y_NO, x8c_IN, x8c_scale_EI


_op = torch.library.custom_op("pith::fp8_grouped_gemm", _forward, mutates_args=())
_weight_op = torch.library.custom_op("pith::fp8_grouped_gemm_weight", quantize_weight, mutates_args=())
_dgrad_op = torch.library.custom_op("pith::fp8_grouped_gemm_dgrad", dgrad, mutates_args=())
_wgrad_op = torch.library.custom_op("pith::fp8_grouped_gemm_wgrad", wgrad, mutates_args=())


@_weight_op.register_fake
def _(w_EIO):
    E, I, O = w_EIO.shape
    fp8, fp32 = torch.float8_e4m3fn, torch.float32
    return (
        empty_cols(E, O, I, device=w_EIO.device), w_EIO.new_empty(E, O, dtype=fp32),
        w_EIO.new_empty(E, I, O, dtype=fp8), w_EIO.new_empty(E, I, dtype=fp32),
    )  # fmt: skip


@_dgrad_op.register_fake
def _(dy_NO, w8r_EIO, w8r_scale_EI, ends):
    return dy_NO.new_empty(dy_NO.shape[0], w8r_EIO.shape[1], dtype=torch.bfloat16)


@_wgrad_op.register_fake
def _(dy_NO, x8c_IN, x8c_scale_EI, ends):
    return dy_NO.new_empty(ends.shape[0], x8c_IN.shape[0], dy_NO.shape[1], dtype=torch.bfloat16)


@_op.register_fake
def _(x_NI, w_EIO, w8c_EOI, w8c_scale_EO, w8r_EIO, w8r_scale_EI, ends, x8_NI=None, x8_scale_N=None):
    (N, I), (E, _, O) = x_NI.shape, w_EIO.shape
    cols = empty_cols(1, I, N, device=x_NI.device)[0]
    return x_NI.new_empty(N, O), cols, x_NI.new_empty(E, I, dtype=torch.float32)


def _setup(ctx, inputs, output):
    _, *saved = output
    ctx.mark_non_differentiable(*saved)
    ctx.set_materialize_grads(False)  # the fp8 and scale outputs get no zero-filled gradients
    ctx.save_for_backward(*saved, *inputs[4:7])
    ctx.dtypes = inputs[0].dtype, inputs[1].dtype


def backward(saved, dy_NO: Tensor, need_dx: bool, dtypes, dgrad=dgrad, wgrad=wgrad):
    """The backward in two halves from the forward's `saved` (x8c_IN, x8c_scale_EI, w8r_EIO,
    w8r_scale_EI, ends) -> (dx_NI now in dtypes[0], or None without need_dx; a closure computing dw_EIO
    in dtypes[1]), so a schedule can run the weight gradient later: the plain backward's kernels."""
    x8c_IN, x8c_scale, w8r, w8r_scale, ends = saved
    dy_NO = dy_NO.contiguous()
    dx = dgrad(dy_NO, w8r, w8r_scale, ends).to(dtypes[0]) if need_dx else None
    return dx, lambda: _cast_back(wgrad(dy_NO, x8c_IN, x8c_scale, ends), dtypes[1])


def _backward(ctx, dy_NO, *_, dgrad=dgrad, wgrad=wgrad):
    """Eager: the functions; the registered autograd (compiled graphs): their custom ops."""
    dx, dw = backward(ctx.saved_tensors, dy_NO, ctx.needs_input_grad[0], ctx.dtypes, dgrad, wgrad)
    return dx, dw() if ctx.needs_input_grad[1] else None, *(None for _ in range(7))


_op.register_autograd(functools.partial(_backward, dgrad=_dgrad_op, wgrad=_wgrad_op), setup_context=_setup)
_fp8_grouped_gemm = eager_or_custom(_op, _setup, _forward, _backward)


def fp8_grouped_gemm_weight(w_EIO: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """quantize_weight(w) as one graph node under torch.compile, without autograd (the gradient reaches
    w through fp8_grouped_gemm's own w argument)."""
    if torch.compiler.is_compiling():
        return _weight_op(w_EIO.detach())
    with torch.no_grad():
        return quantize_weight(w_EIO)


def forward(
    x_NI: Tensor, w_EIO: Tensor, group_ends_E: Tensor, w8=None, x8=(None, None)
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """fp8_grouped_gemm's forward without autograd, for a caller running the backward itself
    (`backward`): -> (y_NO, saved). w8, x8: as fp8_grouped_gemm's."""
    w8 = fp8_grouped_gemm_weight(w_EIO) if w8 is None else w8
    ends = group_ends_E.to(torch.int32).contiguous()
    y, *saved = _forward(x_NI.contiguous(), w_EIO, *w8, ends, *x8)
    return y, (*saved, *w8[2:], ends)


def fp8_grouped_gemm(x_NI: Tensor, w_EIO: Tensor, group_ends_E: Tensor, w8=None, x8=(None, None)) -> Tensor:
    """y_NO in x's dtype with y[group_ends[e-1]:group_ends[e]] = x[...] @ w[e] through FP8 GEMMs and rows
    past group_ends[-1] zero. w may be fp32 (master weights: quantised directly, no bf16 copy).
    w8: fp8_grouped_gemm_weight(w) computed beforehand (of w's current values), or None. x8: (x8_NI,
    x8_scale_N) = quantize_rows(x) made by the pass that wrote x (pith_ops.swiglu_fp8), or Nones.
    On CUDA: I and O multiples of 16 and group ends multiples of 16 (see the module docstring)."""
    check("x_NI", x_NI, ndim=2, dtypes=FLOAT_DTYPES, contiguous=True)
    check("w_EIO", w_EIO, ndim=3, dtypes=FLOAT_DTYPES, device=x_NI.device, contiguous=True)
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
    return _fp8_grouped_gemm(x_NI, w_EIO, *w8, group_ends_E.to(torch.int32).contiguous(), *x8)[0]


def fp8_grouped_gemm_reference(
    x_NI: Tensor, w_EIO: Tensor, group_ends_E: Tensor, dy_NO: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The specification in float64 from the dequantised operands (x8 etc. of the module docstring,
    quantised by the fp8_quant references): -> (y, dx, dw) as in the module docstring."""
    E, I, O = w_EIO.shape
    ends = group_ends_E.to(torch.int32)
    one = torch.full((1,), I, dtype=torch.int32)
    w8c_EIO = dequantize_cols(*quantize_cols_reference(w_EIO, one), one).transpose(1, 2)
    w8r_EIO = dequantize_rows(*quantize_rows_reference(w_EIO.reshape(E * I, O))).view(E, I, O)
    y = grouped_gemm_reference(dequantize_rows(*quantize_rows_reference(x_NI)), w8c_EIO, ends)
    dx = grouped_gemm_reference(dequantize_rows(*quantize_rows_reference(dy_NO)), w8r_EIO.mT, ends)
    x8c_IN = dequantize_cols(*quantize_cols_reference(x_NI[None], ends), ends)[0]
    dy8c_ON = dequantize_cols(*quantize_cols_reference(dy_NO[None], ends), ends)[0]
    starts = [0, *ends[:-1].tolist()]
    dw = torch.stack([x8c_IN[:, s:t] @ dy8c_ON[:, s:t].T for s, t in zip(starts, ends.tolist())])
    return y, dx, dw
