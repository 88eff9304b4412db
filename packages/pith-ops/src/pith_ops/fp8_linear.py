"""FP8 linear: y = x @ w.T with e4m3 operands (pith_ops.fp8_quant), bf16 out.

Shape legend: T rows (tokens; leading dims flattened), D input features, O output features.

Each GEMM's operands are scaled along the axis it contracts (pith-ops README): y = x8 @ w8.T,
dx = dy8 @ w8t.T, dw = dy8c @ x8c.T, with x8 and dy8 by rows (quantize_rows), w8 = quantize_weight(w)
and w8t its transposed copy, dy8c and x8c requantised by columns over T (cols_from_rows). The forward
keeps x8 (half the bytes of the bf16 input).
"""

import torch
from torch import Tensor

from pith_ops._common import FLOAT_DTYPES, check, eager_or_custom
from pith_ops.cast import _cast_back
from pith_ops.fp8_quant import (
    FP8,
    cols_from_rows,
    cols_from_rows_reference,
    dequantize_cols,
    dequantize_rows,
    empty_cols,
    quantize_rows,
    quantize_rows_reference,
    quantize_weight,
    quantize_weight_reference,
)


def _mm(
    a_q: Tensor, a_s: Tensor, bt_q: Tensor, bt_s: Tensor, fast: bool = True, out: Tensor | None = None
) -> Tensor:
    """(a_q * a_s[:, None]) @ (bt_q * bt_s[:, None]).T in bf16; fast: Hopper's fast FP8 accumulation."""
    if a_q.shape[0] * bt_q.shape[0] * a_q.shape[1] == 0:
        y = torch.zeros(a_q.shape[0], bt_q.shape[0], dtype=torch.bfloat16, device=a_q.device)
        return y if out is None else out.copy_(y)
    return torch._scaled_mm(
        a_q, bt_q.t(), a_s[:, None], bt_s[None, :], out_dtype=torch.bfloat16, use_fast_accum=fast, out=out
    )


def dgrad(dy8_TO: Tensor, dy8_scale_T: Tensor, w8t_DO: Tensor, w8t_scale_D: Tensor) -> Tensor:
    """dx_TD = dy @ w."""
    return _mm(dy8_TO, dy8_scale_T, w8t_DO, w8t_scale_D)


def wgrad(dy8_TO: Tensor, dy8_scale_T: Tensor, x8_TD: Tensor, x8_scale_T: Tensor) -> Tensor:
    """dw_OD = dy.T @ x (bf16)."""
    dy8c_OT, dy8c_scale = cols_from_rows(dy8_TO, dy8_scale_T)
    x8c_DT, x8c_scale = cols_from_rows(x8_TD, x8_scale_T)
    # Contracting over all the tokens, fast accumulation doubled the error for 6% less time (README).
    return _mm(dy8c_OT, dy8c_scale[0], x8c_DT, x8c_scale[0], fast=False)


def _forward(
    x_TD: Tensor, w_OD: Tensor, w8_OD: Tensor, w8_scale_O: Tensor, w8t_DO: Tensor, w8t_scale_D: Tensor,
    x8_TD: Tensor, x8_scale_T: Tensor,
) -> Tensor:  # fmt: skip
    """x_TD and w_OD are not read: x8 comes from its own op (_rows_of; why: pith-ops README)."""
    return _mm(x8_TD, x8_scale_T, w8_OD, w8_scale_O).to(x_TD.dtype)


def _weight(w: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return quantize_weight(w)


def _weight_fake(w):  # also fp8_grouped_gemm's (a 3-D w)
    *B, R, C = w.shape
    return (
        w.new_empty(w.shape, dtype=FP8),
        w.new_empty(*B, R, dtype=torch.float32),
        empty_cols(C, R, device=w.device, batch=tuple(B)),
        w.new_empty(*B, C, dtype=torch.float32),
    )


def _rows(x_MK: Tensor) -> tuple[Tensor, Tensor]:
    return quantize_rows(x_MK)


_op = torch.library.custom_op("pith::fp8_linear", _forward, mutates_args=())
_weight_op = torch.library.custom_op("pith::fp8_linear_weight", _weight, mutates_args=())
_weight_op.register_fake(_weight_fake)
_rows_op = torch.library.custom_op("pith::fp8_linear_rows", _rows, mutates_args=())
_dgrad_op = torch.library.custom_op("pith::fp8_linear_dgrad", dgrad, mutates_args=())
_wgrad_op = torch.library.custom_op("pith::fp8_linear_wgrad", wgrad, mutates_args=())


@_rows_op.register_fake
def _(x_MK):
    return torch.empty_like(x_MK, dtype=FP8), x_MK.new_empty(x_MK.shape[0], dtype=torch.float32)


@_dgrad_op.register_fake
def _(dy8_TO, dy8_scale_T, w8t_DO, w8t_scale_D):
    return dy8_TO.new_empty(dy8_TO.shape[0], w8t_DO.shape[0], dtype=torch.bfloat16)


@_wgrad_op.register_fake
def _(dy8_TO, dy8_scale_T, x8_TD, x8_scale_T):
    return dy8_TO.new_empty(dy8_TO.shape[1], x8_TD.shape[1], dtype=torch.bfloat16)


@_op.register_fake
def _(x_TD, w_OD, w8_OD, w8_scale_O, w8t_DO, w8t_scale_D, x8_TD, x8_scale_T):
    return x_TD.new_empty(x_TD.shape[0], w_OD.shape[0])


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[6:8], *inputs[4:6])
    ctx.dtypes = inputs[0].dtype, inputs[1].dtype


def backward(saved, dy_TO: Tensor, need_dx: bool, x_dtype: torch.dtype, ops=(quantize_rows, dgrad, wgrad)):
    """The backward in two halves from the forward's `saved` (x8_TD, x8_scale_T, w8t_DO, w8t_scale_D, then
    what both GEMMs take) -> (dx_TD or None, a closure computing dw_OD in bf16). ops: the three
    functions, or their custom ops."""
    rows, dgrad_fn, wgrad_fn = ops
    x8, x8_scale, w8t, w8t_scale, *extra = saved
    dy8, dy8_scale = rows(dy_TO.contiguous())
    dx = dgrad_fn(dy8, dy8_scale, w8t, w8t_scale, *extra).to(x_dtype) if need_dx else None
    return dx, lambda: wgrad_fn(dy8, dy8_scale, x8, x8_scale, *extra)


def _backward(ops, ctx, dy, *_):
    """Also fp8_grouped_gemm's; ops as backward's."""
    dx, dw = backward(ctx.saved_tensors, dy, ctx.needs_input_grad[0], ctx.dtypes[0], ops)
    dw = _cast_back(dw(), ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
    return dx, dw, *(None for _ in ctx.needs_input_grad[2:])


_fp8_linear = eager_or_custom(
    _op, _setup, _forward, _backward, (_rows_op, _dgrad_op, _wgrad_op), (quantize_rows, dgrad, wgrad)
)


def fp8_linear_weight(w_OD: Tensor, op=_weight_op) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """quantize_weight(w) without autograd, one graph node (op) under torch.compile."""
    if torch.compiler.is_compiling():
        return op(w_OD.detach())
    with torch.no_grad():
        return quantize_weight(w_OD)


def _rows_of(x_TD: Tensor) -> tuple[Tensor, Tensor]:
    """quantize_rows(x), its own graph node under torch.compile."""
    return _rows_op(x_TD.detach()) if torch.compiler.is_compiling() else quantize_rows(x_TD.detach())


def forward(x_TD: Tensor, w_OD: Tensor, w8=None) -> tuple[Tensor, tuple[Tensor, ...]]:
    """fp8_linear's forward on 2-D x without autograd, for a caller running `backward`: -> (y, saved)."""
    _check(x_TD, w_OD, w_OD.requires_grad, w8)
    w8 = fp8_linear_weight(w_OD) if w8 is None else w8
    x8 = _rows_of(x_TD.contiguous())
    return _forward(x_TD, w_OD, *w8[:4], *x8), (*x8, *w8[2:4])


def fp8_linear(x_TD: Tensor, w_OD: Tensor, w8=None) -> Tensor:
    """x @ w.T through FP8 GEMMs, in x's dtype. w8: fp8_linear_weight(w) of w's current values, or None.
    On CUDA the feature sizes (and the rows, when w needs a gradient) must be multiples of 16."""
    _check(x_TD, w_OD, torch.is_grad_enabled() and w_OD.requires_grad, w8)
    w8 = fp8_linear_weight(w_OD) if w8 is None else w8
    x2 = x_TD.reshape(-1, w_OD.shape[1]).contiguous()
    return _fp8_linear(x2, w_OD, *w8[:4], *_rows_of(x2)).view(*x_TD.shape[:-1], w_OD.shape[0])


def _check(x_TD: Tensor, w_OD: Tensor, training: bool, w8) -> None:
    check("x_TD", x_TD, dtypes=FLOAT_DTYPES)  # w is read only without w8 (else a stand-in may do)
    check("w_OD", w_OD, ndim=2, dtypes=FLOAT_DTYPES, device=x_TD.device, contiguous=w8 is None)
    O, D = w_OD.shape
    if x_TD.ndim == 0 or x_TD.shape[-1] != D:
        raise ValueError(f"x_TD: expected a last dimension of {D} (w_OD's columns), got {tuple(x_TD.shape)}")
    if x_TD.is_cuda and (D % 16 or O % 16):
        raise ValueError(
            f"fp8_linear on CUDA needs in/out features that are multiples of 16, got {D} and {O}"
        )
    T = x_TD.numel() // max(D, 1)
    if x_TD.is_cuda and training and T % 16:
        raise ValueError(  # the weight gradient contracts over the rows
            f"fp8_linear on CUDA trains on row counts that are multiples of 16, got {T} rows"
        )


def fp8_linear_reference(x_TD: Tensor, w_OD: Tensor, dy_TO: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The module docstring's GEMMs in float64, dequantised: -> (y, dx, dw)."""
    x8, dy8 = quantize_rows_reference(x_TD), quantize_rows_reference(dy_TO)
    q, scale_O, _, _ = quantize_weight_reference(w_OD[None])
    w8 = dequantize_rows(q[0], scale_O[0])
    one = torch.full((1,), x_TD.shape[0], dtype=torch.int32)
    cols = lambda t8: dequantize_cols(*cols_from_rows_reference(*t8, one), one)
    return dequantize_rows(*x8) @ w8.T, dequantize_rows(*dy8) @ w8, cols(dy8) @ cols(x8).T
