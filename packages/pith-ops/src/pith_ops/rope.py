"""Rotary position embedding, fused forward and backward (rotating by -angle): half-split or
interleaved pairs, partial rotary; x and dy may be strided views (q sliced from a fused qkv
projection) whose last dim is contiguous.

Shape legend: B batch (cos and sin: B or 1), S sequence, H heads, D head dim, R rotated pairs (2R <= D).
"""

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from pith_ops._common import FLOAT_DTYPES, check, eager_or_custom, use_triton


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, T, S, H, D, R,
    stride_xb, stride_xs, stride_xh, stride_cb, stride_cs, stride_sb, stride_ss,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_REST: tl.constexpr,
    INTERLEAVED: tl.constexpr, INVERSE: tl.constexpr,
):  # fmt: skip
    tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    b, s = tokens // S, tokens % S
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    r = tl.arange(0, BLOCK_R)
    cs_mask = (tokens[:, None] < T) & (r[None, :] < R)
    cos = tl.load(cos_ptr + (b * stride_cb + s * stride_cs)[:, None] + r[None, :], mask=cs_mask, other=0.0)
    sin = tl.load(sin_ptr + (b * stride_sb + s * stride_ss)[:, None] + r[None, :], mask=cs_mask, other=0.0)
    cos, sin = cos.to(tl.float32)[:, None, :], sin.to(tl.float32)[:, None, :]
    if INVERSE:
        sin = -sin
    x_head = x_ptr + (b * stride_xb + s * stride_xs)[:, None, None] + heads[None, :, None] * stride_xh
    out_head = out_ptr + (tokens * H * D)[:, None, None] + heads[None, :, None] * D
    head_mask = (tokens[:, None, None] < T) & (heads[None, :, None] < H)
    if INTERLEAVED:
        # One contiguous load of the 2R rotated dims, de-interleaved in registers.
        c = tl.arange(0, 2 * BLOCK_R)[None, None, :]
        mask = head_mask & (c < 2 * R)
        x = tl.load(x_head + c, mask=mask, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, (BLOCK_T, BLOCK_H, BLOCK_R, 2)))
        out = tl.join(x1 * cos - x2 * sin, x2 * cos + x1 * sin)
        tl.store(out_head + c, tl.reshape(out, (BLOCK_T, BLOCK_H, 2 * BLOCK_R)), mask=mask)
    else:
        c = r[None, None, :]
        mask = head_mask & (c < R)
        x1 = tl.load(x_head + c, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_head + R + c, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_head + c, x1 * cos - x2 * sin, mask=mask)
        tl.store(out_head + R + c, x2 * cos + x1 * sin, mask=mask)
    if BLOCK_REST > 0:
        c = 2 * R + tl.arange(0, BLOCK_REST)[None, None, :]
        mask = head_mask & (c < D)
        tl.store(out_head + c, tl.load(x_head + c, mask=mask), mask=mask)


@functools.cache
def _blocks(T: int, H: int, D: int, R: int, elems: int) -> tuple[int, int, int, int, int]:
    """Blocks and warps for ~elems elements a program; cached: a visible share of a ~10 us launch."""
    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_H = min(triton.next_power_of_2(H), max(1, elems // BLOCK_D))
    BLOCK_T = min(triton.next_power_of_2(T), max(1, elems // (BLOCK_H * BLOCK_D)))
    BLOCK_REST = triton.next_power_of_2(D - 2 * R) if D > 2 * R else 0
    warps = min(16, max(1, BLOCK_T * BLOCK_H * BLOCK_D // 512))
    return BLOCK_T, BLOCK_H, triton.next_power_of_2(R), BLOCK_REST, warps


def _launch(
    x_BSHD: Tensor, cos_BSR: Tensor, sin_BSR: Tensor, interleaved: bool, inverse: bool, elems: int = 4096
) -> Tensor:
    """elems: the tile size (sweep: 4096 gets q to 95% of copy, H200)."""
    x_BSHD, cos_BSR, sin_BSR = (
        t if t.stride(-1) == 1 else t.contiguous() for t in (x_BSHD, cos_BSR, sin_BSR)
    )
    B, S, H, D = x_BSHD.shape
    R = cos_BSR.shape[-1]
    out = torch.empty(B, S, H, D, device=x_BSHD.device, dtype=x_BSHD.dtype)
    if out.numel() == 0:
        return out
    BLOCK_T, BLOCK_H, BLOCK_R, BLOCK_REST, warps = _blocks(B * S, H, D, R, elems)
    cb, sb = (t.stride(0) if t.shape[0] > 1 else 0 for t in (cos_BSR, sin_BSR))
    _rope_kernel[(triton.cdiv(B * S, BLOCK_T), triton.cdiv(H, BLOCK_H))](
        x_BSHD, cos_BSR, sin_BSR, out, B * S, S, H, D, R,
        x_BSHD.stride(0), x_BSHD.stride(1), x_BSHD.stride(2), cb, cos_BSR.stride(1), sb, sin_BSR.stride(1),
        BLOCK_T, BLOCK_H, BLOCK_R, BLOCK_REST, interleaved, inverse, num_warps=warps,
    )  # fmt: skip
    return out


def _forward(x_BSHD: Tensor, cos_BSR: Tensor, sin_BSR: Tensor, interleaved: bool, inverse: bool) -> Tensor:
    if not use_triton(x_BSHD):
        return apply_rope_reference(
            x_BSHD, cos_BSR, -sin_BSR if inverse else sin_BSR, interleaved
        ).contiguous()
    return _launch(x_BSHD, cos_BSR, sin_BSR, interleaved, inverse)


_rope_op = torch.library.custom_op("pith::rope", _forward, mutates_args=())


@_rope_op.register_fake
def _(x_BSHD, cos_BSR, sin_BSR, interleaved, inverse):
    return x_BSHD.new_empty(x_BSHD.shape)


def _setup_context(ctx, inputs, output):
    _, cos_BSR, sin_BSR, ctx.interleaved, ctx.inverse = inputs
    ctx.save_for_backward(cos_BSR, sin_BSR)


def _grads(rotate, ctx, dy_BSHD):
    cos_BSR, sin_BSR = ctx.saved_tensors
    return rotate(dy_BSHD, cos_BSR, sin_BSR, ctx.interleaved, not ctx.inverse), None, None, None, None


_rope = eager_or_custom(_rope_op, _setup_context, _forward, _grads, _rope_op, _forward)


def apply_rope(x_BSHD: Tensor, cos_BSR: Tensor, sin_BSR: Tensor, interleaved: bool = False) -> Tensor:
    """apply_rope_reference; the gradient is x's only."""
    check("x_BSHD", x_BSHD, ndim=4, dtypes=FLOAT_DTYPES)
    check("cos_BSR", cos_BSR, ndim=3, dtypes=FLOAT_DTYPES, device=x_BSHD.device)
    check("sin_BSR", sin_BSR, ndim=3, dtypes=FLOAT_DTYPES, device=x_BSHD.device)
    B, S, H, D = x_BSHD.shape
    R = cos_BSR.shape[-1]
    if sin_BSR.shape != cos_BSR.shape or cos_BSR.shape[:2] not in ((B, S), (1, S)) or not 0 < 2 * R <= D:
        raise ValueError(
            f"cos_BSR, sin_BSR: expected equal shapes ({B} or 1, {S}, R) with 0 < 2R <= {D} for x of "
            f"shape {tuple(x_BSHD.shape)}, got {tuple(cos_BSR.shape)} and {tuple(sin_BSR.shape)}"
        )
    return _rope(x_BSHD, cos_BSR, sin_BSR, interleaved, False)


def apply_rope_reference(
    x_BSHD: Tensor, cos_BSR: Tensor, sin_BSR: Tensor, interleaved: bool = False
) -> Tensor:
    """Rotate pairs (i, i+R), or interleaved (2i, 2i+1), of each head's first 2R dims; the rest pass
    through. In fp32 (float64 input: float64), out in x.dtype."""
    R = cos_BSR.shape[-1]
    acc = torch.promote_types(x_BSHD.dtype, torch.float32)
    xf = x_BSHD.to(acc)
    rot, rest = xf[..., : 2 * R], xf[..., 2 * R :]
    cos, sin = cos_BSR[:, :, None, :].to(acc), sin_BSR[:, :, None, :].to(acc)
    x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., :R], rot[..., R:])
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    out = torch.stack((o1, o2), dim=-1).flatten(-2) if interleaved else torch.cat((o1, o2), dim=-1)
    return torch.cat((out, rest), dim=-1).to(x_BSHD.dtype)
