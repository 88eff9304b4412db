"""RMSNorm, fused forward and backward (dx and dweight), plain `w` and `(1 + w)` weight forms.

Shape legend: N rows (leading dims flattened), D normalised width; weight_D.

Memory-bound. Each program holds whole rows in registers (BLOCK_D = next_pow2(D)), so the forward
reads x once and writes y once, and the backward reads x and dy once and writes dx once,
recomputing 1/rms from the row it already holds instead of saving it. The weight gradient is summed
over rows: each backward program owns a strided set of rows and keeps its partial sum in registers,
writes one fp32 row of partials, and a [P, D] sum finishes it (P = 4 per SM, a few MB against the
~200 MB the 16384 x 2048 bf16 backward moves), with no atomics.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from pith_ops._common import FLOAT_DTYPES, check, use_triton


@triton.jit
def _rms_norm_forward_kernel(
    x_ptr, w_ptr, y_ptr, N, D, eps, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, UNIT_OFFSET: tl.constexpr
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < N) & (cols[None, :] < D)
    offs = rows[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        w += 1.0
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    tl.store(y_ptr + offs, x * rstd[:, None] * w[None, :], mask=mask)


@triton.jit
def _rms_norm_backward_kernel(
    x_ptr,
    w_ptr,
    dy_ptr,
    dx_ptr,
    dw_partial_ptr,
    N,
    D,
    eps,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
):
    """dx = rstd * (g - xhat * mean(g * xhat)) with g = dy * w; dw partial = sum over rows of dy * xhat."""
    cols = tl.arange(0, BLOCK_D)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        w += 1.0
    dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for tile in range(tl.program_id(0), tl.cdiv(N, ROWS), tl.num_programs(0)):
        rows = (tile * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        mask = (rows[:, None] < N) & (cols[None, :] < D)
        offs = rows[:, None] * D + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        xhat = x * rstd[:, None]
        g = dy * w[None, :]
        c = tl.sum(g * xhat, axis=1) / D
        tl.store(dx_ptr + offs, (g - xhat * c[:, None]) * rstd[:, None], mask=mask)
        dw += tl.sum(dy * xhat, axis=0)
    tl.store(dw_partial_ptr + tl.program_id(0) * D + cols, dw, mask=cols < D)


def _blocks(N: int, D: int) -> tuple[int, int, int]:
    """Rows per program, BLOCK_D and warps: ~4096 elements per program, 16 per thread (2 x 16-byte
    bf16 loads), so narrow rows (a per-head q/k norm, D=128) still give each program enough work."""
    BLOCK_D = triton.next_power_of_2(D)
    ROWS = min(max(1, 4096 // BLOCK_D), triton.next_power_of_2(N))
    return ROWS, BLOCK_D, min(16, max(1, ROWS * BLOCK_D // 512))


def _forward(x_ND: Tensor, weight_D: Tensor, eps: float, unit_offset: bool) -> Tensor:
    x_ND = x_ND.contiguous()
    y_ND = x_ND.new_empty(x_ND.shape)
    N, D = x_ND.shape
    if N == 0:
        return y_ND
    ROWS, BLOCK_D, warps = _blocks(N, D)
    _rms_norm_forward_kernel[(triton.cdiv(N, ROWS),)](
        x_ND, weight_D.contiguous(), y_ND, N, D, eps, ROWS, BLOCK_D, unit_offset, num_warps=warps
    )
    return y_ND


def _backward_launch(
    dy_ND: Tensor, x_ND: Tensor, weight_D: Tensor, eps: float, unit_offset: bool
) -> tuple[Tensor, Tensor]:
    x_ND, dy_ND = x_ND.contiguous(), dy_ND.contiguous()
    N, D = x_ND.shape
    dx_ND = x_ND.new_empty(x_ND.shape)
    ROWS, BLOCK_D, warps = _blocks(N, D)
    sms = torch.cuda.get_device_properties(x_ND.device).multi_processor_count if x_ND.is_cuda else 1
    P = max(1, min(triton.cdiv(N, ROWS), 4 * sms))
    dw_partial_PD = torch.empty(P, D, device=x_ND.device, dtype=torch.float32)
    _rms_norm_backward_kernel[(P,)](
        x_ND, weight_D.contiguous(), dy_ND, dx_ND, dw_partial_PD, N, D, eps, ROWS, BLOCK_D, unit_offset,
        num_warps=warps,
    )  # fmt: skip
    return dx_ND, dw_partial_PD.sum(0).to(weight_D.dtype)


@torch.library.custom_op("pith::rms_norm", mutates_args=())
def _rms_norm_op(x_ND: Tensor, weight_D: Tensor, eps: float, unit_offset: bool) -> Tensor:
    if not use_triton(x_ND):
        return rms_norm_reference(x_ND, weight_D, eps, unit_offset).contiguous()
    return _forward(x_ND, weight_D, eps, unit_offset)


@_rms_norm_op.register_fake
def _(x_ND, weight_D, eps, unit_offset):
    return x_ND.new_empty(x_ND.shape)


@torch.library.custom_op("pith::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(
    dy_ND: Tensor, x_ND: Tensor, weight_D: Tensor, eps: float, unit_offset: bool
) -> tuple[Tensor, Tensor]:
    if not use_triton(x_ND):
        _, vjp = torch.func.vjp(lambda x, w: rms_norm_reference(x, w, eps, unit_offset), x_ND, weight_D)
        return tuple(g.contiguous() for g in vjp(dy_ND))
    return _backward_launch(dy_ND, x_ND, weight_D, eps, unit_offset)


@_rms_norm_backward_op.register_fake
def _(dy_ND, x_ND, weight_D, eps, unit_offset):
    return x_ND.new_empty(x_ND.shape), weight_D.new_empty(weight_D.shape)


def _setup_context(ctx, inputs, output):
    x_ND, weight_D, ctx.eps, ctx.unit_offset = inputs
    ctx.save_for_backward(x_ND, weight_D)


def _backward(ctx, dy_ND):
    x_ND, weight_D = ctx.saved_tensors
    dx_ND, dw_D = _rms_norm_backward_op(dy_ND, x_ND, weight_D, ctx.eps, ctx.unit_offset)
    return dx_ND, dw_D, None, None


_rms_norm_op.register_autograd(_backward, setup_context=_setup_context)


def rms_norm(x: Tensor, weight: Tensor, eps: float, unit_offset: bool = False) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * w (or * (1 + w)) over the last dim; fp32 math, out in x.dtype.
    Fused Triton forward and backward (dx and dweight)."""
    check("x", x, dtypes=FLOAT_DTYPES)
    check("weight", weight, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
    if x.ndim == 0 or x.shape[-1] != weight.shape[0] or weight.shape[0] == 0:
        raise ValueError(
            f"weight: expected shape ({x.shape[-1] if x.ndim else 'D'},) matching the last dim of x "
            f"(non-empty), got {tuple(weight.shape)} for x of shape {tuple(x.shape)}"
        )
    if not eps > 0:  # eps > 0 also keeps the kernels' masked padding rows finite
        raise ValueError(f"eps: expected a positive float, got {eps}")
    D = x.shape[-1]
    return _rms_norm_op(x.reshape(-1, D), weight, float(eps), unit_offset).view(x.shape)


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float, unit_offset: bool = False) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * w (or * (1 + w) with unit_offset), computed in fp32 (float64 for
    float64 input), out in x.dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.to(acc) + 1.0 if unit_offset else weight.to(acc)
    return (y * w).to(x.dtype)
