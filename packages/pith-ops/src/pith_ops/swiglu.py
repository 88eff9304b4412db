"""SwiGLU activations, fused forward and backward: silu(gate) * up, and GPT-OSS's clamped variant.

Shape legend: N rows (leading dims flattened), F hidden width; x_N2F holds gate and up (halves for
`swiglu`, interleaved for `swiglu_oss`). The backward recomputes the activation rather than saving it.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from pith_ops._common import FLOAT_DTYPES, INTERPRET, check, eager_or_custom, use_triton
from pith_ops.fp8_quant import FP8, _cast, _interpreted_cast, _pow2_scale, quantize_rows_reference

# Rows per program and warps; columns in blocks of 256 (F=768: three, unmasked).
_CONFIGS = [triton.Config({"BLOCK_N": n}, num_warps=w) for n, w in ((8, 4), (4, 4), (16, 8), (8, 8), (32, 8))]


@triton.autotune(_CONFIGS[:1] if INTERPRET else _CONFIGS, key=["F", "OSS", "BACKWARD"])
@triton.jit
def _swiglu_kernel(
    x_ptr, dy_ptr, out_ptr, N, F, alpha, limit,
    BLOCK_F: tl.constexpr, OSS: tl.constexpr, BACKWARD: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Forward: out = y_NF. Backward: out = dx_N2F from dy_NF."""
    # Column blocks vary fastest, so programs running together cover whole rows (contiguous memory).
    col_blocks = tl.cdiv(F, BLOCK_F)
    rows = ((tl.program_id(0) // col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    col_block = tl.program_id(0) % col_blocks
    cols = col_block * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows[:, None] < N) & (cols[None, :] < F)
    x_row = x_ptr + rows[:, None] * (2 * F)
    if OSS:
        # One contiguous load keeps the access vectorised; split de-interleaves.
        cols2 = col_block * 2 * BLOCK_F + tl.arange(0, 2 * BLOCK_F)
        mask2 = (rows[:, None] < N) & (cols2[None, :] < 2 * F)
        x = tl.load(x_row + cols2[None, :], mask=mask2, other=0.0).to(tl.float32)
        gate, up = tl.split(tl.reshape(x, (BLOCK_N, BLOCK_F, 2)))
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit) + 1.0
    else:
        gate = tl.load(x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_row + F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g, u = gate, up
    s = tl.sigmoid(alpha * g)
    if BACKWARD:
        dy = tl.load(dy_ptr + rows[:, None] * F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dgate = dy * u * s * (1.0 + alpha * g * (1.0 - s))
        dup = dy * g * s
        if OSS:
            # The clamps pass gradient only where they do not saturate (torch.clamp's convention).
            dgate = tl.where(gate <= limit, dgate, 0.0)
            dup = tl.where((up >= -limit) & (up <= limit), dup, 0.0)
            dx = tl.reshape(tl.join(dgate, dup), (BLOCK_N, 2 * BLOCK_F))
            tl.store(out_ptr + rows[:, None] * (2 * F) + cols2[None, :], dx, mask=mask2)
        else:
            dx_row = out_ptr + rows[:, None] * (2 * F)
            tl.store(dx_row + cols[None, :], dgate, mask=mask)
            tl.store(dx_row + F + cols[None, :], dup, mask=mask)
    else:
        tl.store(out_ptr + rows[:, None] * F + cols[None, :], g * s * u, mask=mask)


@triton.jit
def _swiglu_fp8_kernel(x_ptr, y_ptr, q_ptr, s_ptr, N, F, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr):
    """y = silu(gate) * up for BLOCK_N whole rows, then quantize_rows(y) (pass 2 rereads y from L2)."""
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    amax = tl.zeros([BLOCK_N], dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        mask = (rows[:, None] < N) & (cols[None, :] < F)
        gate = tl.load(x_ptr + rows[:, None] * (2 * F) + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + rows[:, None] * (2 * F) + F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = (gate * tl.sigmoid(gate) * up).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rows[:, None] * F + cols[None, :], y, mask=mask)
        amax = tl.maximum(amax, tl.max(tl.abs(y.to(tl.float32)), 1))
    scale, inv = _pow2_scale(amax)
    tl.store(s_ptr + rows, scale, mask=rows < N)
    tl.debug_barrier()  # y's stores visible to all this program's threads
    for f0 in range(0, F, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        mask = (rows[:, None] < N) & (cols[None, :] < F)
        y = tl.load(y_ptr + rows[:, None] * F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        q = _cast(y, inv[:, None]).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + rows[:, None] * F + cols[None, :], q, mask=mask)


# (rows, columns) a step of the FP8 variant, whose programs take whole rows.
FP8_TILE = (4, 128) if INTERPRET else (8, 256)


def _forward_fp8(x_N2F: Tensor, out_dtype: torch.dtype = FP8) -> tuple[Tensor, Tensor, Tensor]:
    if not use_triton(x_N2F):
        y = swiglu_reference(x_N2F).contiguous()
        return y, *quantize_rows_reference(y, out_dtype)
    if INTERPRET and out_dtype == FP8:  # see _interpreted_cast
        y, q32, scale = _forward_fp8(x_N2F, torch.float32)
        return y, *_interpreted_cast(q32, scale)
    N, F = x_N2F.shape[0], x_N2F.shape[1] // 2
    y, q = x_N2F.new_empty(N, F), x_N2F.new_empty(N, F, dtype=out_dtype)
    scale = x_N2F.new_empty(N, dtype=torch.float32)
    if N:
        bn, bf = FP8_TILE
        bf = min(bf, triton.next_power_of_2(F))
        _swiglu_fp8_kernel[(triton.cdiv(N, bn),)](
            x_N2F, y, q, scale, N, F, BLOCK_N=bn, BLOCK_F=bf, num_warps=4
        )
    return y, q, scale


def _launch(x_N2F: Tensor, dy_NF: Tensor | None, oss: bool, alpha: float, limit: float) -> Tensor:
    x_N2F = x_N2F.contiguous()
    N, F = x_N2F.shape[0], x_N2F.shape[1] // 2
    out = x_N2F.new_empty(N, 2 * F if dy_NF is not None else F)
    if N == 0:
        return out
    BLOCK_F = min(256, triton.next_power_of_2(F))
    col_blocks = triton.cdiv(F, BLOCK_F)
    dy = dy_NF.contiguous() if dy_NF is not None else x_N2F
    _swiglu_kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]) * col_blocks,)](
        x_N2F, dy, out, N, F, alpha, limit, BLOCK_F, oss, dy_NF is not None
    )
    return out


def _reference(x_N2F: Tensor, oss: bool, alpha: float, limit: float) -> Tensor:
    return swiglu_oss_reference(x_N2F, alpha, limit) if oss else swiglu_reference(x_N2F)


def _forward(x_N2F: Tensor, oss: bool, alpha: float, limit: float) -> Tensor:
    if not use_triton(x_N2F):
        return _reference(x_N2F, oss, alpha, limit).contiguous()
    return _launch(x_N2F, None, oss, alpha, limit)


def _backward(dy_NF: Tensor, x_N2F: Tensor, oss: bool, alpha: float, limit: float) -> Tensor:
    if not use_triton(x_N2F):
        _, vjp = torch.func.vjp(lambda x: _reference(x, oss, alpha, limit), x_N2F)
        return vjp(dy_NF)[0].contiguous()
    return _launch(x_N2F, dy_NF, oss, alpha, limit)


_swiglu_op = torch.library.custom_op("pith::swiglu", _forward, mutates_args=())
_swiglu_backward_op = torch.library.custom_op("pith::swiglu_backward", _backward, mutates_args=())


@_swiglu_op.register_fake
def _(x_N2F, oss, alpha, limit):
    return x_N2F.new_empty(x_N2F.shape[0], x_N2F.shape[1] // 2)


@_swiglu_backward_op.register_fake
def _(dy_NF, x_N2F, oss, alpha, limit):
    return x_N2F.new_empty(x_N2F.shape)


def _setup_context(ctx, inputs, output):
    x_N2F, ctx.oss, ctx.alpha, ctx.limit = inputs
    ctx.save_for_backward(x_N2F)


def _grads(backward, ctx, dy_NF):
    (x_N2F,) = ctx.saved_tensors
    return backward(dy_NF, x_N2F, ctx.oss, ctx.alpha, ctx.limit), None, None, None


_swiglu = eager_or_custom(_swiglu_op, _setup_context, _forward, _grads, _swiglu_backward_op, _backward)


_swiglu_fp8_op = torch.library.custom_op("pith::swiglu_fp8", _forward_fp8, mutates_args=())


@_swiglu_fp8_op.register_fake
def _(x_N2F, out_dtype=FP8):
    N, F = x_N2F.shape[0], x_N2F.shape[1] // 2
    return (
        x_N2F.new_empty(N, F),
        x_N2F.new_empty(N, F, dtype=out_dtype),
        x_N2F.new_empty(N, dtype=torch.float32),
    )


def _setup_fp8(ctx, inputs, output):
    ctx.mark_non_differentiable(*output[1:])
    _setup_context(ctx, (inputs[0], False, 1.0, 0.0), output)


def _grads_fp8(backward, ctx, dy_NF, *_):
    return _grads(backward, ctx, dy_NF)[0], None


_swiglu_fp8 = eager_or_custom(
    _swiglu_fp8_op, _setup_fp8, _forward_fp8, _grads_fp8, _swiglu_backward_op, _backward
)


def _check_x(x_N2F: Tensor) -> None:
    check("x_N2F", x_N2F, dtypes=FLOAT_DTYPES)
    if x_N2F.ndim == 0 or x_N2F.shape[-1] == 0 or x_N2F.shape[-1] % 2:
        raise ValueError(
            f"x_N2F: expected a last dimension 2F > 0 holding gate and up, got shape {tuple(x_N2F.shape)}"
        )


def _apply(x_N2F: Tensor, oss: bool, alpha: float, limit: float) -> Tensor:
    _check_x(x_N2F)
    F = x_N2F.shape[-1] // 2
    return _swiglu(x_N2F.reshape(-1, 2 * F), oss, alpha, limit).view(*x_N2F.shape[:-1], F)


def swiglu(x_N2F: Tensor) -> Tensor:
    """swiglu_reference."""
    return _apply(x_N2F, False, 1.0, 0.0)


def swiglu_fp8(x_N2F: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """-> (y_NF = swiglu(x), and quantize_rows(y) undifferentiable: fp8_grouped_gemm's x8) in one pass."""
    _check_x(x_N2F)
    if x_N2F.ndim != 2:
        raise ValueError(f"x_N2F: expected 2 dimensions [N, 2F], got shape {tuple(x_N2F.shape)}")
    return _swiglu_fp8(x_N2F.contiguous())


def swiglu_oss(x_N2F: Tensor, alpha: float = 1.702, limit: float = 7.0) -> Tensor:
    """swiglu_oss_reference."""
    if not limit > 0:
        raise ValueError(f"limit: expected a positive clamp limit, got {limit}")
    return _apply(x_N2F, True, float(alpha), float(limit))


def swiglu_reference(x_N2F: Tensor) -> Tensor:
    """silu(gate) * up with gate = x[..., :F], up = x[..., F:]."""
    gate, up = x_N2F.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def swiglu_oss_reference(x_N2F: Tensor, alpha: float = 1.702, limit: float = 7.0) -> Tensor:
    """GPT-OSS: gate = x[..., ::2].clamp(max=limit), up = x[..., 1::2].clamp(-limit, limit),
    out = gate * sigmoid(alpha * gate) * (up + 1)."""
    gate = x_N2F[..., ::2].clamp(max=limit)
    up = x_N2F[..., 1::2].clamp(-limit, limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)
