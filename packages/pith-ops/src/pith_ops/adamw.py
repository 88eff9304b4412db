"""AdamW update of one fp32 tensor with its gradient scaled by a device scalar (the clip coefficient).

A scale in device memory spares the clipping a host sync and a pass over the gradients (~6 ms a step
on the bench, H200); a non-finite one skips the update, so the trainer need not check the
loss on the host. p's kept copies are rewritten in the same pass (FP8: delayed scaling, the new amax
reduced by atomics for the next update).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from pith_ops._common import check, use_triton
from pith_ops.cast import keep
from pith_ops.fp8_quant import (
    FP8,
    FP8Weight,
    _cast,
    _entry_amax,
    _pow2_scale,
    quantize_weight_reference,
    weight_copies,
)


@triton.jit
def _adamw_kernel(
    p_ptr, g_ptr, m_ptr, v_ptr, scale_ptr, bias_ptr, copy_ptr, q_ptr, amax_ptr, amax_new_ptr, N, RC, decay,
    rest1, beta2, rest2, eps, COPY: tl.constexpr, FP8: tl.constexpr, ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """BLOCK elements of p (flat); with FP8 element i is of batch entry i // RC."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    scale = tl.load(scale_ptr)
    if scale - scale == 0:  # finite (inf - inf and nan - nan are nan)
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32) * scale
        p = tl.load(p_ptr + offs, mask=mask) * decay
        m = tl.load(m_ptr + offs, mask=mask)
        m = tl.fma(rest1, g - m, m)  # m.lerp_(g, rest1), as torch's vectorised CPU lerp computes it
        v = tl.load(v_ptr + offs, mask=mask) * beta2 + rest2 * (g * g)
        denom = tl.div_rn(tl.sqrt_rn(v), tl.load(bias_ptr + 1)) + eps
        p = p - tl.load(bias_ptr) * tl.div_rn(m, denom)
        tl.store(p_ptr + offs, p, mask=mask)
        if COPY:  # bf16 by round to nearest even on the bits, as torch's cast (the interpreter truncates)
            bits = p.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            tl.store(copy_ptr + offs, bits.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        if FP8:  # quantize_weight's copy of the new p with the old amax's scale
            b, amax = _entry_amax(amax_ptr, offs, mask, RC, ALIGNED, BLOCK)
            _, inv = _pow2_scale(amax)
            tl.store(q_ptr + offs, _cast(p, inv).to(q_ptr.dtype.element_ty), mask=mask)
            _amax_into(amax_new_ptr, b, tl.abs(p), mask, ALIGNED)
    elif FP8:  # nothing changes: the old amax stays
        b, amax = _entry_amax(amax_ptr, offs, mask, RC, ALIGNED, BLOCK)
        _amax_into(amax_new_ptr, b, amax, mask, ALIGNED)


@triton.jit
def _amax_into(amax_ptr, b, values, mask, ALIGNED: tl.constexpr):
    """amax[b] = max(amax[b], values): one atomic a block when ALIGNED, else one per element."""
    if ALIGNED:
        tl.atomic_max(amax_ptr + b, tl.max(tl.where(mask, values, 0.0), 0))
    else:
        tl.atomic_max(amax_ptr + b, values, mask=mask)


def step_constants(lr: float, beta1: float, beta2: float, step: int | Tensor, device=None) -> Tensor:
    """(step size, sqrt of the second bias correction) of update `step`: [..., 2] fp32, computed in
    double as torch.optim.AdamW does."""
    step = torch.as_tensor(step, dtype=torch.float64, device=device)
    return torch.stack([lr / (1 - beta1**step), (1 - beta2**step).sqrt()], -1).float()


def adamw_(
    p: Tensor, g: Tensor, m: Tensor, v: Tensor, scale: Tensor, *,
    lr: float, beta1: float, beta2: float, weight_decay: float, eps: float, step: int | Tensor,
    copy: Tensor | None = None, fp8: FP8Weight | None = None,
) -> None:  # fmt: skip
    """In place: AdamW step `step` (or its step_constants) of p with gradient g * scale and moments m, v
    (fp32, contiguous, one shape; g may be bf16); nothing is written when scale is not finite. copy
    (bf16): set to the new p, kept. fp8 (FP8Weight): set to quantize_weight(new p, old amax), kept with
    the new p's amax. Other kept copies of p are dropped."""
    fp32, bf16 = (torch.float32,), (torch.bfloat16,)
    tensors = [("p", p, fp32), ("g", g, (*fp32, *bf16)), ("m", m, fp32), ("v", v, fp32), ("copy", copy, bf16)]
    for name, t, dtypes in tensors[:4] if copy is None else tensors:
        check(name, t, dtypes=dtypes, device=p.device, contiguous=True)
        if t.shape != p.shape:
            raise ValueError(f"{name}: expected the parameter's shape {tuple(p.shape)}, got {tuple(t.shape)}")
    check("scale", scale, dtypes=(torch.float32,), device=p.device)
    if isinstance(step, Tensor):
        check("step", step, dtypes=(torch.float32,), device=p.device)
    if scale.numel() != 1 or (step.shape != (2,) if isinstance(step, Tensor) else step < 1):
        raise ValueError(
            f"expected a one-element scale and step >= 1 (or its step_constants), got {scale.numel()}"
            f" elements, step {step}"
        )
    if fp8 is not None:
        if len(fp8) != 5 or p.ndim not in (2, 3) or fp8[0].shape != p.shape:
            raise ValueError(f"fp8: expected the 5 FP8Weight tensors of a 2-D or 3-D p {tuple(p.shape)}")
        fp8 = FP8Weight(*fp8)
        if fp8.amax.shape != (p.shape[0] if p.ndim == 3 else 1,):
            raise ValueError(f"fp8.amax: expected one amax per expert (or one), got {tuple(fp8.amax.shape)}")
    if not use_triton(p):
        kw = dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, step=step)
        return adamw_reference_(p, g, m, v, scale, **kw, copy=copy, fp8=fp8)
    bias = step if isinstance(step, Tensor) else step_constants(lr, beta1, beta2, step, p.device)
    amax_new = None if fp8 is None else torch.zeros_like(fp8.amax)
    BLOCK = 4096  # 8 warps: 16 fp32 a thread, four 16-byte accesses per tensor
    q, amax, per_entry = (
        (p, p, 1) if fp8 is None else (fp8.q, fp8.amax, p[0].numel() if p.ndim == 3 else p.numel())
    )
    _adamw_kernel[(triton.cdiv(p.numel(), BLOCK),)](
        p, g, m, v, scale, bias, p if copy is None else copy, q, amax, p if amax_new is None else amax_new,
        p.numel(), per_entry, 1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, eps,
        COPY=copy is not None, FP8=fp8 is not None, ALIGNED=per_entry % BLOCK == 0, BLOCK=BLOCK, num_warps=8,
    )  # fmt: skip
    if fp8 is not None:  # the scales and the transposed copy
        weight_copies(fp8, gate=scale)
    # The kernel's writes leave p's version counter as it was.
    _rekeep(p, copy, None if fp8 is None else fp8._replace(amax=amax_new))


@torch.no_grad()
def adamw_reference_(
    p: Tensor, g: Tensor, m: Tensor, v: Tensor, scale: Tensor, *,
    lr: float, beta1: float, beta2: float, weight_decay: float, eps: float, step: int | Tensor,
    copy: Tensor | None = None, fp8: FP8Weight | None = None,
) -> None:  # fmt: skip
    """adamw_ in plain PyTorch: torch.optim.AdamW's single-tensor path on g * scale."""
    step_size, bc2_sqrt = step if isinstance(step, Tensor) else step_constants(lr, beta1, beta2, step)
    g = g.to(p.dtype) * scale
    p_new, m_new, v_new = p * (1 - lr * weight_decay), m.lerp(g, 1 - beta1), v * beta2
    v_new.addcmul_(g, g, value=1 - beta2)
    # addcdiv_(m, denom, value=-step_size) as torch computes it, (value * m) / denom, bit for bit
    p_new.add_(m_new.mul(-step_size).div_(v_new.sqrt().div_(bc2_sqrt).add_(eps)))
    finite = torch.isfinite(scale)
    for t, new in ((p, p_new), (m, m_new), (v, v_new)):
        t.copy_(torch.where(finite, new, t))
    if copy is not None:
        copy.copy_(p)
    if fp8 is not None:
        fp8, p3 = FP8Weight(*fp8), (p if p.ndim == 3 else p[None])
        for t, new in zip(fp8[:4], quantize_weight_reference(p3, fp8.amax, fp8.q.dtype)):
            new = new if p.ndim == 3 else new[0]
            t.copy_(torch.where(finite, new.float(), t.float()).to(t.dtype))
        fp8 = fp8._replace(amax=torch.where(finite, p3.abs().flatten(1).amax(1), fp8.amax))
    _rekeep(p, copy, fp8)


def _rekeep(p: Tensor, copy: Tensor | None, fp8: FP8Weight | None) -> None:
    """Keep the copies an update rewrote, drop any other."""
    p.__dict__.pop("_pith_copies", None)
    if copy is not None:
        keep(p, copy)
    if fp8 is not None:
        keep(p, fp8, FP8)
