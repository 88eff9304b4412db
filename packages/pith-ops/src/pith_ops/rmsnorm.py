"""RMSNorm, fused forward and backward (dx and dweight); the passes and the weight gradient's partial
sums: pith-ops README.

Shape legend: N rows (leading dims flattened), D normalised width; weight_D.
"""

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from pith_ops._common import FLOAT_DTYPES, INTERPRET, check, eager_or_custom, use_triton

# ELEMS elements per program and warps: D=2048 and D=128 want different shapes. The backward also tunes
# programs per SM (more hide latency, fewer write fewer partials; 60-128 registers a thread, sm_90).
_SHAPES = ((2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 8), (8192, 16))
_CONFIGS = [triton.Config({"ELEMS": e}, num_warps=w) for e, w in _SHAPES]
_BACKWARD_CONFIGS = [
    triton.Config({"ELEMS": e, "PER_SM": s}, num_warps=w) for e, w in _SHAPES for s in (2, 4)
]
_CONFIGS, _BACKWARD_CONFIGS = (
    (_CONFIGS[2:3], _BACKWARD_CONFIGS[4:5]) if INTERPRET else (_CONFIGS, _BACKWARD_CONFIGS)
)


@triton.autotune(_CONFIGS, key=["D"])
@triton.jit
def _rms_norm_forward_kernel(x_ptr, w_ptr, y_ptr, N, D, eps, BLOCK_D: tl.constexpr, ELEMS: tl.constexpr):
    ROWS: tl.constexpr = (ELEMS + BLOCK_D - 1) // BLOCK_D
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < N) & (cols[None, :] < D)
    offs = rows[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    tl.store(y_ptr + offs, x * rstd[:, None] * w[None, :], mask=mask)


@triton.autotune(_BACKWARD_CONFIGS, key=["D"])
@triton.jit
def _rms_norm_backward_kernel(
    x_ptr, w_ptr, dy_ptr, dx_ptr, dw_partial_ptr, N, D, eps,
    BLOCK_D: tl.constexpr, ELEMS: tl.constexpr,
    PER_SM: tl.constexpr,  # programs per SM: read by the launcher
):  # fmt: skip
    """dx = rstd * (g - xhat * mean(g * xhat)) with g = dy * w; dw partial = sum over rows of dy * xhat.
    Program p owns tiles [p * n / P, (p + 1) * n / P), loading tile i + 1 before computing tile i."""
    ROWS: tl.constexpr = (ELEMS + BLOCK_D - 1) // BLOCK_D
    n_tiles = tl.cdiv(N, ROWS)
    pid = tl.program_id(0).to(tl.int64)
    first, end = pid * n_tiles // tl.num_programs(0), (pid + 1) * n_tiles // tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    row_end = tl.minimum(end * ROWS, N)  # this program's rows end here
    # Only the scalar first row is advanced: 2D int64 offsets cost registers per element.
    r = tl.arange(0, ROWS)
    tile_offs = r[:, None] * D + cols[None, :]
    col_mask = cols[None, :] < D
    row0 = first * ROWS
    mask = (row0 + r[:, None] < row_end) & col_mask
    x_raw = tl.load(x_ptr + row0 * D + tile_offs, mask=mask, other=0.0)
    dy_raw = tl.load(dy_ptr + row0 * D + tile_offs, mask=mask, other=0.0)
    # Summed over rows once after the loop: a per-tile sum over rows would cross warps every tile.
    dw_acc = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)
    for _ in range(first, end):
        next_mask = (row0 + ROWS + r[:, None] < row_end) & col_mask
        x_next = tl.load(x_ptr + (row0 + ROWS) * D + tile_offs, mask=next_mask, other=0.0)
        dy_next = tl.load(dy_ptr + (row0 + ROWS) * D + tile_offs, mask=next_mask, other=0.0)
        x, dy = x_raw.to(tl.float32), dy_raw.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        xhat = x * rstd[:, None]
        g = dy * w[None, :]
        c = tl.sum(g * xhat, axis=1) / D
        dx = (g - xhat * c[:, None]) * rstd[:, None]
        tl.store(dx_ptr + row0 * D + tile_offs, dx, mask=(row0 + r[:, None] < row_end) & col_mask)
        dw_acc += dy * xhat
        row0, x_raw, dy_raw = row0 + ROWS, x_next, dy_next
    tl.store(dw_partial_ptr + pid * D + cols, tl.sum(dw_acc, axis=0), mask=cols < D)


@triton.jit
def _sum_partials_kernel(dw_partial_ptr, dw_ptr, P, D, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """dw[c] = sum over the P partial rows."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        mask = (p[:, None] < P) & (cols[None, :] < D)
        acc += tl.load(dw_partial_ptr + p[:, None] * D + cols[None, :], mask=mask, other=0.0)
    tl.store(dw_ptr + cols, tl.sum(acc, axis=0), mask=cols < D)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _forward(x_ND: Tensor, weight_D: Tensor, eps: float) -> Tensor:
    if not use_triton(x_ND):
        return rms_norm_reference(x_ND, weight_D, eps).contiguous()
    x_ND = x_ND.contiguous()
    y_ND = x_ND.new_empty(x_ND.shape)
    N, D = x_ND.shape
    if N == 0:
        return y_ND
    BLOCK_D = triton.next_power_of_2(D)
    _rms_norm_forward_kernel[lambda meta: (triton.cdiv(N, triton.cdiv(meta["ELEMS"], BLOCK_D)),)](
        x_ND, weight_D.contiguous(), y_ND, N, D, eps, BLOCK_D
    )
    return y_ND


def _backward(dy_ND: Tensor, x_ND: Tensor, weight_D: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    if not use_triton(x_ND):
        _, vjp = torch.func.vjp(lambda x, w: rms_norm_reference(x, w, eps), x_ND, weight_D)
        return tuple(g.contiguous() for g in vjp(dy_ND))
    x_ND, dy_ND, weight_D = x_ND.contiguous(), dy_ND.contiguous(), weight_D.contiguous()
    N, D = x_ND.shape
    dx_ND = x_ND.new_empty(x_ND.shape)
    dw_D = weight_D.new_empty(D)
    # Programs without a tile write zeros.
    sms = _sm_count(x_ND.device)
    dw_partial_PD = x_ND.new_empty(max(1, min(N, 4 * sms)), D, dtype=torch.float32)
    kernel = _rms_norm_backward_kernel
    kernel[lambda meta: (max(1, min(N, meta["PER_SM"] * sms)),)](
        x_ND, weight_D, dy_ND, dx_ND, dw_partial_PD, N, D, eps, triton.next_power_of_2(D)
    )
    P = max(1, min(N, kernel.best_config.kwargs["PER_SM"] * sms))  # the grid the tuned config ran
    _sum_partials_kernel[(triton.cdiv(D, 32),)](dw_partial_PD, dw_D, P, D, BLOCK_P=128, BLOCK_C=32)
    return dx_ND, dw_D


_rms_norm_op = torch.library.custom_op("pith::rms_norm", _forward, mutates_args=())
_rms_norm_backward_op = torch.library.custom_op("pith::rms_norm_backward", _backward, mutates_args=())


@_rms_norm_op.register_fake
def _(x_ND, weight_D, eps):
    return x_ND.new_empty(x_ND.shape)


@_rms_norm_backward_op.register_fake
def _(dy_ND, x_ND, weight_D, eps):
    return x_ND.new_empty(x_ND.shape), weight_D.new_empty(weight_D.shape)


def _setup_context(ctx, inputs, output):
    x_ND, weight_D, ctx.eps = inputs
    ctx.save_for_backward(x_ND, weight_D)


def _grads(backward, ctx, dy_ND):
    x_ND, weight_D = ctx.saved_tensors
    dx_ND, dw_D = backward(dy_ND, x_ND, weight_D, ctx.eps)
    return dx_ND, dw_D, None


_rms_norm = eager_or_custom(_rms_norm_op, _setup_context, _forward, _grads, _rms_norm_backward_op, _backward)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """rms_norm_reference."""
    check("x", x, dtypes=FLOAT_DTYPES)
    check("weight", weight, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
    if x.ndim == 0 or x.shape[-1] != weight.shape[0] or weight.shape[0] == 0:
        raise ValueError(
            f"weight: expected shape ({x.shape[-1] if x.ndim else 'D'},) matching the last dim of x "
            f"(non-empty), got {tuple(weight.shape)} for x of shape {tuple(x.shape)}"
        )
    if not eps > 0:  # eps > 0 also keeps the kernels' masked padding rows finite
        raise ValueError(f"eps: expected a positive float, got {eps}")
    return _rms_norm(x.reshape(-1, x.shape[-1]), weight, float(eps)).view(x.shape)


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * w, in fp32 (float64 input: float64), out in x.dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(acc)).to(x.dtype)
