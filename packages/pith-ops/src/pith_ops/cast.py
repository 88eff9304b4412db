"""A differentiable dtype cast whose backward casts the gradient back with a vectorised kernel.

Shape legend: N elements (any shape; a contiguous bf16/fp16 gradient cast to fp32 takes the kernel).

Why: a master weight cast to bf16 for its GEMMs (x.to(bf16)) gets its gradient back through torch's
bf16 -> fp32 copy, which (converting dtypes) runs torch's unrolled, unvectorised elementwise loop:
measured on an H200 in the pith-train bench (2026-12-03), 8.4 ms a step for the expert and lm_head
weight gradients (2.7B elements, 16.4 GB), 47% of copy bandwidth. The Triton cast streams 16-byte
accesses. The forward is torch's cast (fp32 -> bf16 copies take its vectorised kernel already).
The FP8 GEMMs (fp8_linear, fp8_grouped_gemm) widen their bf16 weight gradients with it too.

Kept copies. A trainable weight cast to bf16 (a leaf that requires grad, a plain tensor: not FSDP's
DTensor, whose mixed-precision policy casts on its own) cast while grad mode is on keeps its cast in
`x._pith_copies`, stamped with x's version counter and storage; later casts, micro-batches and steps
reuse it while the stamp holds (any in-place torch op on x bumps the counter, so a checkpoint load or
another optimizer invalidates it). pith_ops.adamw_ rewrites the copy in its update pass, 2 bytes more
per element instead of a 6-byte cast per use: on the pith-train bench (2.73B expert and lm_head
weights) ~1.3 ms at copy bandwidth for ~3.8 ms of casts (H200 profile, pith-train README). The copy
holds x.to(bf16) bit for bit. A write to x that bypasses the counter (x.data, a raw kernel) must go
through `keep`. FSDP2 with the trainer's bf16 param_dtype hands the forward bf16 weights: nothing is
cast or kept (an fp32 param_dtype with a bf16 stream would keep copies of unsharded parameters that its
all-gather refills: not a layout the trainer builds). pith_ops._common.KEEP_COPIES = False turns the
copies off (the bench's A/B).

Kept gradients. A weight whose optimizer reads `grad(w)` (pith-train's AdamW marks its parameters
with `keep_grads`) gets the gradient of its kept cast as it arrives, in bf16, held beside `w.grad`
rather than widened into it: every bf16 value is an fp32 one, so the optimizer reading the bf16
gradient computes what it computed from the widened one, bit for bit, and nothing pays the widening
pass (6 bytes per element) or the fp32 gradient's extra 2-byte reads in the norm and the update: on
the pith-train bench's 2.73B expert and lm_head weights (H200, 2026-12-04) the widening took 4.1 ms a
step and the norm + update 26.2 ms, 24.4 with bf16 gradients; with the kept casts 114,525 -> 119,263
tokens/s in one process (pith-train README). A second micro-batch's gradient is added in fp32 (what `.grad`
accumulation does); a gradient that reaches w by another edge too (a tied embedding) lands in w.grad
and `grad(w)` adds the two. Unmarked tensors (anything read through `.grad` or autograd.grad) get
the widened gradient as before.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from pith_ops import _common
from pith_ops._common import FLOAT_DTYPES, check, use_triton


@triton.jit
def _cast_kernel(x_ptr, y_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask).to(y_ptr.dtype.element_ty), mask=mask)


def _cast_back(g: Tensor, dtype: torch.dtype) -> Tensor:
    # Widening only (exact: every bf16/fp16 value is an fp32 one); narrowing takes torch's rounding,
    # and a tensor subclass (a DTensor under FSDP) its own dispatch.
    if (
        dtype != torch.float32
        or g.dtype == dtype
        or not g.is_contiguous()
        or not use_triton(g)
        or type(g) is not Tensor
    ):
        return g.to(dtype)
    out = torch.empty_like(g, dtype=dtype)
    BLOCK = 4096  # 8 warps: 16 elements a thread
    _cast_kernel[(triton.cdiv(g.numel(), BLOCK),)](g, out, g.numel(), BLOCK=BLOCK, num_warps=8)
    return out


class _Cast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dtype, copy):
        ctx.dtype = x.dtype
        ctx.holder = x if copy is not None and x.__dict__.get("_pith_keep_grad") else None
        # No gradient stays none (a weight gradient deferred to a queue): no zeros cast and accumulated.
        ctx.set_materialize_grads(False)
        return x.to(dtype) if copy is None else copy.view_as(copy)

    @staticmethod
    def backward(ctx, g):
        if g is None or ctx.holder is None:
            return None if g is None else _cast_back(g, ctx.dtype), None, None
        return weight_grad(ctx.holder, g), None, None  # held when bf16 (stand_in's may be fp16)


def kept_copy(x: Tensor, kind: torch.dtype = torch.bfloat16):
    """x's kept copy of this kind if it is still valid, else None: its cast (kind bf16, module
    docstring) or its FP8 copies (kind float8_e4m3fn: pith_ops.fp8_quant.quantize_weight's four
    outputs and the amax of x, which pith_ops.adamw_ rewrites)."""
    kept = x.__dict__.get("_pith_copies", {}).get(kind)
    return kept[1] if kept is not None and kept[0] == (x._version, x.data_ptr()) else None


def keep(x: Tensor, copy, kind: torch.dtype = torch.bfloat16) -> None:
    """Record `copy` as x's kept copy of this kind (its values x's as they are now), valid until x changes."""
    # The storage too: a copied tensor (deepcopy copies __dict__) starts its own version count.
    x.__dict__.setdefault("_pith_copies", {})[kind] = ((x._version, x.data_ptr()), copy)


def hold_grad(x: Tensor, g: Tensor) -> None:
    """Add g (bf16 or x's dtype) to the gradient x holds (module docstring: kept gradients)."""
    held = x.__dict__.get("_pith_grad")
    if held is None:
        x._pith_grad = g
    elif held.dtype == x.dtype:
        held.add_(g)
    else:  # the second micro-batch: fp32 from here on, as .grad accumulates
        x._pith_grad = _cast_back(held, x.dtype).add_(g)


def weight_grad(x: Tensor, g: Tensor) -> Tensor | None:
    """g as x's gradient: held by x (None returned) when x keeps its gradients and g is x's kept cast's
    dtype (a bf16 weight gradient of pith_ops' GEMMs), else widened to x's dtype for autograd."""
    if x.__dict__.get("_pith_keep_grad") and g.dtype == torch.bfloat16 and x.dtype == torch.float32:
        hold_grad(x, g)
        return None
    return _cast_back(g, x.dtype)


def keep_grads(params) -> None:
    """Mark `params` as read through `grad` (their kept casts hold their gradients: module docstring)."""
    for p in params:
        p._pith_keep_grad = True


def grad(x: Tensor) -> Tensor | None:
    """x's gradient: x.grad, the gradient its kept cast holds (bf16, or fp32 after accumulation), or
    their sum (folded into x.grad) when both hold one."""
    held = x.__dict__.get("_pith_grad")
    if held is None or x.grad is None:
        return x.grad if held is None else held
    x.grad += held
    del x._pith_grad
    return x.grad


def drop_grad(x: Tensor) -> None:
    """Drop the gradient x's kept cast holds (an optimizer's zero_grad; x.grad is torch's to clear)."""
    x.__dict__.pop("_pith_grad", None)


def _copy_for(x: Tensor, dtype: torch.dtype) -> Tensor | None:
    if (
        dtype != torch.bfloat16
        or not _common.KEEP_COPIES
        or torch.compiler.is_compiling()
        or not (x.is_leaf and x.requires_grad)
        or type(x) not in (Tensor, torch.nn.Parameter)
    ):
        return None
    copy = kept_copy(x)
    if copy is not None:
        return copy
    if not torch.is_grad_enabled():  # evaluation uses a valid copy, makes none
        return None
    copy = x.detach().to(dtype)
    keep(x, copy)
    return copy


def stand_in(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x in dtype without its values (zeros, strides 0; a plain x itself when already of dtype), the
    gradient going back as cast's does (held in bf16 when x keeps its gradients): for an op that reads
    x through other copies and returns x's gradient in dtype (linear_cross_entropy with w8), so that no
    cast of x is kept (the bench's lm_head: 0.6 GiB), or that cannot read x (a tensor subclass holding
    other copies only: pith_engine.layers.GatheredFP8)."""
    check("x", x, dtypes=FLOAT_DTYPES)
    if x.dtype == dtype and type(x) in (Tensor, torch.nn.Parameter):
        return x
    return _Cast.apply(x, dtype, torch.zeros((), dtype=dtype, device=x.device).expand(x.shape))


def cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x.to(dtype), the gradient cast back to x's dtype (the same values as torch's cast gives); from
    x's kept copy when it has a valid one (module docstring)."""
    check("x", x, dtypes=FLOAT_DTYPES)
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype: expected one of {[str(d) for d in FLOAT_DTYPES]}, got {dtype}")
    return x if x.dtype == dtype else _Cast.apply(x, dtype, _copy_for(x, dtype))
