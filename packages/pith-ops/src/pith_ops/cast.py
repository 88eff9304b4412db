"""A differentiable dtype cast whose backward casts the gradient back with a vectorised kernel.

Shape legend: N elements (any shape; a contiguous bf16/fp16 gradient cast to fp32 takes the kernel).

Why: a master weight cast to bf16 for its GEMMs (x.to(bf16)) gets its gradient back through torch's
bf16 -> fp32 copy, which (converting dtypes) runs torch's unrolled, unvectorised elementwise loop:
measured on an H200 in the pith-train bench (2026-12-03), 8.4 ms a step for the expert and lm_head
weight gradients (2.7B elements, 16.4 GB), 47% of copy bandwidth. The Triton cast streams 16-byte
accesses. The forward is torch's cast (fp32 -> bf16 copies take its vectorised kernel already).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

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
    def forward(ctx, x, dtype):
        ctx.dtype = x.dtype
        # No gradient stays none (a weight gradient deferred to a queue): no zeros cast and accumulated.
        ctx.set_materialize_grads(False)
        return x.to(dtype)

    @staticmethod
    def backward(ctx, g):
        return None if g is None else _cast_back(g, ctx.dtype), None


def cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x.to(dtype), the gradient cast back to x's dtype (the same values as torch's cast gives)."""
    check("x", x, dtypes=FLOAT_DTYPES)
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype: expected one of {[str(d) for d in FLOAT_DTYPES]}, got {dtype}")
    return x if x.dtype == dtype else _Cast.apply(x, dtype)
