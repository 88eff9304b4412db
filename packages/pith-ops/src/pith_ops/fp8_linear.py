"""FP8 linear: y = x @ w.T with e4m3 operands scaled per row (pith_ops.fp8_quant), bf16 out.

Shape legend: T rows (tokens; leading dims are flattened), D input features, O output features.

Every GEMM takes its left operand quantised along its rows and its right operand along the contracted
axis too, each with one fp32 power-of-two scale per row or column (the recipe and its measurements:
the pith-ops README):
- forward  y  = x8 @ w8.T        x8: x by rows (over D), w8: w by rows (over D);
- dgrad    dx = dy8 @ w8c        dy8: dy by rows (over O), w8c: w by columns (over O), stored [D, O];
- wgrad    dw = dy8c.T @ x8c     dy8c, x8c: dy and x by columns (over T), stored transposed.
The forward keeps x8c (fp8: half the bytes of the bf16 input autograd would keep) and w8c for the
backward. w8 and w8c come from `fp8_linear_weight(w)`, a function of w alone, which a caller may
compute once for several calls (pith_engine.layers caches it across an optimizer step's micro-batches).
`forward` and `backward` are the op without autograd, its backward in two halves (dx now, dw when
asked), so a schedule can run the weight gradient later. On CUDA the GEMMs are torch._scaled_mm,
with fast accumulation except in the wgrad, which contracts over all the tokens; torch's CPU
_scaled_mm serves CPU runs.
"""

import functools

import torch
from torch import Tensor

from pith_ops._common import FLOAT_DTYPES, check, eager_or_custom
from pith_ops.cast import _cast_back
from pith_ops.fp8_quant import (
    FP8,
    dequantize_cols,
    dequantize_rows,
    empty_cols,
    quantize_cols,
    quantize_cols_reference,
    quantize_rows,
    quantize_rows_reference,
)


def _mm(a_q: Tensor, a_s: Tensor, bt_q: Tensor, bt_s: Tensor, fast: bool = True) -> Tensor:
    """(a_q * a_s[:, None]) @ (bt_q * bt_s[:, None]).T in bf16; both row-quantised, [M, K] and [N, K].
    fast: Hopper's fast FP8 accumulation, else fp32 promotion (measured in the README's recipe table)."""
    if a_q.shape[0] * bt_q.shape[0] * a_q.shape[1] == 0:
        return torch.zeros(a_q.shape[0], bt_q.shape[0], dtype=torch.bfloat16, device=a_q.device)
    return torch._scaled_mm(
        a_q, bt_q.t(), a_s[:, None], bt_s[None, :], out_dtype=torch.bfloat16, use_fast_accum=fast
    )


def dgrad(dy_TO: Tensor, w8c_DO: Tensor, w8c_scale_D: Tensor) -> Tensor:
    """dx_TD = dy @ w through the column-quantised weight the forward kept."""
    return _mm(*quantize_rows(dy_TO), w8c_DO, w8c_scale_D)


def wgrad(dy_TO: Tensor, x8c_DT: Tensor, x8c_scale_D: Tensor) -> Tensor:
    """dw_OD = dy.T @ x through the column-quantised input the forward kept."""
    dy8c_OT, dy8c_scale = quantize_cols(dy_TO)
    # Contracting over all the tokens (16,384 in the bench) fast accumulation doubled the error (3.5e-3
    # against 1.7e-3 relative, H200) for 6% more time (206 against 218 us at [2048, 16384] x [16384, 4096]).
    return _mm(dy8c_OT, dy8c_scale[0], x8c_DT, x8c_scale_D, fast=False)


def quantize_weight(w_OD: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (w8_OD, w8_scale_O: w by rows, the forward's operand; w8c_DO, w8c_scale_D: w by columns,
    dgrad's). A function of w alone: a caller may compute it once and pass it to several calls
    (pith_engine.layers caches it across the micro-batches of an optimizer step)."""
    w8_OD, w8_scale_O = quantize_rows(w_OD)
    w8c_DO, w8c_scale = quantize_cols(w_OD)
    return w8_OD, w8_scale_O, w8c_DO, w8c_scale[0]


def _forward(
    x_TD: Tensor, w_OD: Tensor, w8_OD: Tensor, w8_scale_O: Tensor, w8c_DO: Tensor, w8c_scale_D: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """w_OD is not read (quantize_weight's outputs are): it is the input the weight gradient is for."""
    y_TO = _mm(*quantize_rows(x_TD), w8_OD, w8_scale_O).to(x_TD.dtype)
    x8c_DT, x8c_scale = quantize_cols(x_TD)
    return y_TO, x8c_DT, x8c_scale[0]


_op = torch.library.custom_op("pith::fp8_linear", _forward, mutates_args=())
_weight_op = torch.library.custom_op("pith::fp8_linear_weight", quantize_weight, mutates_args=())
_dgrad_op = torch.library.custom_op("pith::fp8_linear_dgrad", dgrad, mutates_args=())
_wgrad_op = torch.library.custom_op("pith::fp8_linear_wgrad", wgrad, mutates_args=())


@_weight_op.register_fake
def _(w_OD):
    O, D = w_OD.shape
    scale = dict(dtype=torch.float32)
    return (
        w_OD.new_empty(O, D, dtype=FP8),
        w_OD.new_empty(O, **scale),
        empty_cols(1, D, O, device=w_OD.device)[0],
        w_OD.new_empty(D, **scale),
    )


@_dgrad_op.register_fake
def _(dy_TO, w8c_DO, w8c_scale_D):
    return dy_TO.new_empty(dy_TO.shape[0], w8c_DO.shape[0], dtype=torch.bfloat16)


@_wgrad_op.register_fake
def _(dy_TO, x8c_DT, x8c_scale_D):
    return dy_TO.new_empty(dy_TO.shape[1], x8c_DT.shape[0], dtype=torch.bfloat16)


@_op.register_fake
def _(x_TD, w_OD, w8_OD, w8_scale_O, w8c_DO, w8c_scale_D):
    T, D = x_TD.shape
    cols = empty_cols(1, D, T, device=x_TD.device)[0]
    return x_TD.new_empty(T, w_OD.shape[0]), cols, x_TD.new_empty(D, dtype=torch.float32)


def _setup(ctx, inputs, output):
    _, *saved = output
    ctx.mark_non_differentiable(*saved)
    ctx.set_materialize_grads(False)  # the fp8 and scale outputs get no zero-filled gradients
    ctx.save_for_backward(*saved, *inputs[4:])
    ctx.dtypes = inputs[0].dtype, inputs[1].dtype


def backward(saved, dy_TO: Tensor, need_dx: bool, dtypes, dgrad=dgrad, wgrad=wgrad):
    """The backward in two halves from the forward's `saved` (x8c_DT, x8c_scale_D, w8c_DO, w8c_scale_D)
    -> (dx_TD now in dtypes[0], or None without need_dx; a closure computing dw_OD in dtypes[1]), so a
    schedule can run the weight gradient later (pith_engine.layers): the same kernels as a plain
    backward, bit for bit."""
    x8c_DT, x8c_scale, w8c_DO, w8c_scale = saved
    dy_TO = dy_TO.contiguous()
    dx = dgrad(dy_TO, w8c_DO, w8c_scale).to(dtypes[0]) if need_dx else None
    return dx, lambda: _cast_back(wgrad(dy_TO, x8c_DT, x8c_scale), dtypes[1])


def _backward(ctx, dy_TO, *_, dgrad=dgrad, wgrad=wgrad):
    """Eager: the functions; the registered autograd (compiled graphs): their custom ops."""
    dx, dw = backward(ctx.saved_tensors, dy_TO, ctx.needs_input_grad[0], ctx.dtypes, dgrad, wgrad)
    return dx, dw() if ctx.needs_input_grad[1] else None, None, None, None, None


_op.register_autograd(functools.partial(_backward, dgrad=_dgrad_op, wgrad=_wgrad_op), setup_context=_setup)
_fp8_linear = eager_or_custom(_op, _setup, _forward, _backward)


def fp8_linear_weight(w_OD: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """quantize_weight(w) as one graph node under torch.compile, without autograd (its outputs are
    fp8 and scales: the gradient reaches w through fp8_linear's own w argument)."""
    if torch.compiler.is_compiling():
        return _weight_op(w_OD.detach())
    with torch.no_grad():
        return quantize_weight(w_OD)


def forward(x_TD: Tensor, w_OD: Tensor, w8=None) -> tuple[Tensor, tuple[Tensor, ...]]:
    """fp8_linear's forward on 2-D x without autograd, for a caller running the backward itself
    (`backward`): -> (y_TO, saved). w8: fp8_linear_weight(w), or None to compute it here."""
    _check(x_TD, w_OD, w_OD.requires_grad)
    w8 = fp8_linear_weight(w_OD) if w8 is None else w8
    y, *saved = _forward(x_TD.contiguous(), w_OD, *w8)
    return y, (*saved, *w8[2:])


def fp8_linear(x_TD: Tensor, w_OD: Tensor, w8=None) -> Tensor:
    """x @ w.T (nn.Linear's layout: w is [out, in]) through FP8 GEMMs, in x's dtype; x may have leading dims.
    w8: fp8_linear_weight(w) computed beforehand (it must be of w's current values), or None.
    On CUDA the feature sizes, and when w needs a gradient the rows, must be multiples of 16 (the FP8
    GEMM's alignment along the contracted axis)."""
    _check(x_TD, w_OD, torch.is_grad_enabled() and w_OD.requires_grad)
    w8 = fp8_linear_weight(w_OD) if w8 is None else w8
    y = _fp8_linear(x_TD.reshape(-1, w_OD.shape[1]).contiguous(), w_OD, *w8)[0]
    return y.view(*x_TD.shape[:-1], w_OD.shape[0])


def _check(x_TD: Tensor, w_OD: Tensor, training: bool) -> None:
    check("x_TD", x_TD, dtypes=FLOAT_DTYPES)
    check("w_OD", w_OD, ndim=2, dtypes=FLOAT_DTYPES, device=x_TD.device, contiguous=True)
    D, O = w_OD.shape[1], w_OD.shape[0]
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
    """The specification in float64 from the dequantised operands (x8 etc. of the module docstring,
    quantised by the fp8_quant references): -> (y = x8 @ w8.T, dx = dy8 @ w8c, dw = dy8c.T @ x8c)."""

    def rows(t):
        return dequantize_rows(*quantize_rows_reference(t))

    def cols_t(t):  # t's columns quantised, transposed: [K, M]
        ends = torch.full((1,), t.shape[0], dtype=torch.int32)
        return dequantize_cols(*quantize_cols_reference(t[None], ends), ends)[0]

    return rows(x_TD) @ rows(w_OD).T, rows(dy_TO) @ cols_t(w_OD).T, cols_t(dy_TO) @ cols_t(x_TD).T
