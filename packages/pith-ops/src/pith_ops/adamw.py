"""AdamW update of one fp32 tensor with its gradient scaled by a device scalar (the clip coefficient).

Shape legend: N elements (any shape, contiguous; all four tensors alike).

Memory-bound: the kernel reads parameter, gradient and both moments once and writes parameter and
moments once (28 bytes per element; 26 with a bf16 gradient), the gradient scale read from device
memory so that clipping needs neither a host sync nor its own read-write pass over the gradients (8
bytes per element more, ~6 ms per step on the pith-train bench's 3.11B parameters on an H200). A
non-finite scale skips the update, so a trainer can hand a non-finite loss to the kernel instead of
checking it on the host.
The math is torch.optim.AdamW's (decoupled weight decay, bias-corrected moments, eps after the
square root) in the operation order of its single-tensor path.

`copy`: p's kept bf16 cast (pith_ops.cast's kept copies), rewritten in the same pass as the new p
rounded to bf16 (2 bytes more per element), so the next forward casts nothing.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from pith_ops._common import check, use_triton
from pith_ops.cast import keep


@triton.jit
def _adamw_kernel(
    p_ptr, g_ptr, m_ptr, v_ptr, scale_ptr, copy_ptr, N, decay, rest1, beta2, rest2, step_size, bc2_sqrt,
    eps, COPY: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    scale = tl.load(scale_ptr)
    if scale - scale == 0:  # finite (inf - inf and nan - nan are nan)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32) * scale
        p = tl.load(p_ptr + offs, mask=mask) * decay
        m = tl.load(m_ptr + offs, mask=mask)
        m = tl.fma(rest1, g - m, m)  # m.lerp_(g, rest1), as torch's vectorised CPU lerp computes it
        v = tl.load(v_ptr + offs, mask=mask) * beta2 + rest2 * (g * g)
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p - step_size * tl.div_rn(m, denom)
        tl.store(p_ptr + offs, p, mask=mask)
        if (
            COPY
        ):  # bf16 by round to nearest even on the bits, as torch's cast (Triton's interpreter truncates)
            b = p.to(tl.uint32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
            tl.store(copy_ptr + offs, b.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)


def _constants(lr: float, beta1: float, beta2: float, weight_decay: float, step: int):
    """(decay factor, 1 - beta1, 1 - beta2, step size, sqrt of the second bias correction), in double
    on the host as torch.optim.AdamW computes them (the kernel gets them rounded to fp32, as torch's
    tensor ops do)."""
    return 1 - lr * weight_decay, 1 - beta1, 1 - beta2, lr / (1 - beta1**step), (1 - beta2**step) ** 0.5


def adamw_(
    p: Tensor, g: Tensor, m: Tensor, v: Tensor, scale: Tensor, *,
    lr: float, beta1: float, beta2: float, weight_decay: float, eps: float, step: int,
    copy: Tensor | None = None,
) -> None:  # fmt: skip
    """In place: AdamW step number `step` (1-based) of parameter p with gradient g * scale and moments
    m, v (fp32, contiguous, one shape; g may be bf16: a kept gradient, pith_ops.cast); nothing is
    written when scale (a one-element fp32 tensor on p's device) is not finite. copy (bf16, p's shape,
    contiguous): set to the new p in bf16 and kept as p's cast (pith_ops.cast). Triton on CUDA (and
    under the interpreter), adamw_reference_ otherwise."""
    fp32, bf16 = (torch.float32,), (torch.bfloat16,)
    tensors = [("p", p, fp32), ("g", g, (*fp32, *bf16)), ("m", m, fp32), ("v", v, fp32), ("copy", copy, bf16)]
    for name, t, dtypes in tensors[:4] if copy is None else tensors:
        check(name, t, dtypes=dtypes, device=p.device, contiguous=True)
        if t.shape != p.shape:
            raise ValueError(f"{name}: expected the parameter's shape {tuple(p.shape)}, got {tuple(t.shape)}")
    check("scale", scale, dtypes=(torch.float32,), device=p.device)
    if scale.numel() != 1 or step < 1:
        raise ValueError(
            f"expected a one-element scale and step >= 1, got {scale.numel()} elements, step {step}"
        )
    if not use_triton(p):
        return adamw_reference_(p, g, m, v, scale, lr=lr, beta1=beta1, beta2=beta2,
                                weight_decay=weight_decay, eps=eps, step=step, copy=copy)  # fmt: skip
    decay, rest1, rest2, step_size, bc2_sqrt = _constants(lr, beta1, beta2, weight_decay, step)
    # 4096 elements, 8 warps: 16 fp32 a thread, four 16-byte accesses per tensor.
    BLOCK = 4096
    _adamw_kernel[(triton.cdiv(p.numel(), BLOCK),)](
        p,
        g,
        m,
        v,
        scale,
        p if copy is None else copy,
        p.numel(),
        decay,
        rest1,
        beta2,
        rest2,
        step_size,
        bc2_sqrt,
        eps,
        COPY=copy is not None,
        BLOCK=BLOCK,
        num_warps=8,
    )
    if copy is not None:
        keep(p, copy)  # the kernel's writes leave p's version counter as it was: stamped consistent


@torch.no_grad()
def adamw_reference_(
    p: Tensor, g: Tensor, m: Tensor, v: Tensor, scale: Tensor, *,
    lr: float, beta1: float, beta2: float, weight_decay: float, eps: float, step: int,
    copy: Tensor | None = None,
) -> None:  # fmt: skip
    """adamw_ in plain PyTorch: torch.optim.AdamW's single-tensor path on g * scale (no host read of
    scale: a non-finite one selects the old values); copy set to the new p cast to its dtype."""
    decay, rest1, rest2, step_size, bc2_sqrt = _constants(lr, beta1, beta2, weight_decay, step)
    g = g.to(p.dtype) * scale
    p_new, m_new, v_new = p * decay, m.lerp(g, rest1), (v * beta2).addcmul_(g, g, value=rest2)
    p_new.addcdiv_(m_new, v_new.sqrt().div_(bc2_sqrt).add_(eps), value=-step_size)
    finite = torch.isfinite(scale)
    for t, new in ((p, p_new), (m, m_new), (v, v_new)):
        t.copy_(torch.where(finite, new, t))
    if copy is not None:
        copy.copy_(p)
        keep(p, copy)
