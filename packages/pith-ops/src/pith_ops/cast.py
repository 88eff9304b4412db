"""A differentiable dtype cast whose backward widens the gradient with a vectorised kernel (torch's
cast: 47% of copy; README).

Kept copies. A trainable weight (not a DTensor) cast to bf16 with grad mode on keeps its cast, valid
while x's version counter and storage hold; adamw_ rewrites it in its update pass (bench: ~1.3 ms for
~3.8 ms of casts, H200). A write to x bypassing the version counter must go through `keep`.

Kept gradients. A weight marked by `keep_grads` holds its kept cast's gradient in bf16 (`grad(w)`),
not widened into w.grad: no widening pass, narrower reads (bench: 4.1 and 1.8 ms a step, H200).
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
    # Widening only (exact); narrowing takes torch's rounding, a tensor subclass (DTensor) its own dispatch.
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
        # No gradient stays None (a deferred weight gradient): no zeros cast and accumulated.
        ctx.set_materialize_grads(False)
        return x.to(dtype) if copy is None else copy.view_as(copy)

    @staticmethod
    def backward(ctx, g):
        if g is None or ctx.holder is None:
            return None if g is None else _cast_back(g, ctx.dtype), None, None
        return weight_grad(ctx.holder, g), None, None  # held when bf16 (stand_in's may be fp16)


def kept_copy(x: Tensor, kind: torch.dtype = torch.bfloat16):
    """x's kept bf16 cast (kind float8_e4m3fn: its FP8Weight) if still valid, else None."""
    kept = x.__dict__.get("_pith_copies", {}).get(kind)
    return kept[1] if kept is not None and kept[0] == (x._version, x.data_ptr()) else None


def keep(x: Tensor, copy, kind: torch.dtype = torch.bfloat16) -> None:
    """Record `copy` as x's kept copy of this kind, valid until x changes."""
    # The storage too: a copied tensor (deepcopy copies __dict__) starts its own version count.
    x.__dict__.setdefault("_pith_copies", {})[kind] = ((x._version, x.data_ptr()), copy)


def weight_grad(x: Tensor, g: Tensor) -> Tensor | None:
    """g as x's gradient: held by x (-> None) when x keeps its gradients, else widened."""
    if not (x.__dict__.get("_pith_keep_grad") and g.dtype == torch.bfloat16 and x.dtype == torch.float32):
        return _cast_back(g, x.dtype)
    held = x.__dict__.get("_pith_grad")
    if held is None:
        x._pith_grad = g
    elif held.dtype == x.dtype:
        held.add_(g)
    else:  # the second micro-batch: fp32 from here on, as .grad accumulates
        x._pith_grad = _cast_back(held, x.dtype).add_(g)
    return None


def keep_grads(params) -> None:
    """Mark `params` as read through `grad`."""
    for p in params:
        p._pith_keep_grad = True


def grad(x: Tensor) -> Tensor | None:
    """x.grad, the gradient x's kept cast holds, or their sum (into x.grad)."""
    held = x.__dict__.get("_pith_grad")
    if held is None or x.grad is None:
        return x.grad if held is None else held
    x.grad += held
    del x._pith_grad
    return x.grad


def drop_grad(x: Tensor) -> None:
    """Drop the gradient x's kept cast holds (an optimizer's zero_grad)."""
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
    """x in dtype without its values (README): no cast of x kept (the bench's lm_head: 0.6 GiB)."""
    check("x", x, dtypes=FLOAT_DTYPES)
    if x.dtype == dtype and type(x) in (Tensor, torch.nn.Parameter):
        return x
    return _Cast.apply(x, dtype, torch.zeros((), dtype=dtype, device=x.device).expand(x.shape))


def cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x.to(dtype), the gradient cast back; x's kept copy when valid."""
    check("x", x, dtypes=FLOAT_DTYPES)
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype: expected one of {[str(d) for d in FLOAT_DTYPES]}, got {dtype}")
    return x if x.dtype == dtype else _Cast.apply(x, dtype, _copy_for(x, dtype))
