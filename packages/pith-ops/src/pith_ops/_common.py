"""Input checks, the kernel-or-reference decision and the eager/compiled switch shared by the
operators, and the grouped-GEMM and kept-cast switches (kept here because pith_ops re-exports the
functions grouped_gemm and cast over the names of their modules, so the modules are awkward to reach)."""

import os
from collections.abc import Callable

import torch
from torch import Tensor

# Triton runs on CUDA tensors, and on CPU tensors only under its interpreter (how CI tests kernels).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: Tensor) -> bool:
    return t.is_cuda or INTERPRET


def check(
    name: str, t: Tensor, *, ndim: int | None = None, dtypes=None, device=None, contiguous=False
) -> None:
    """Raise ValueError naming the argument, what was expected and what came."""
    if not isinstance(t, Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous tensor (call .contiguous()), got strides {t.stride()}"
        )


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def eager_or_custom(
    custom_op: Callable, setup_context: Callable, forward_fn: Callable, backward_fn: Callable
) -> Callable:
    """-> a callable running custom_op under torch.compile (one opaque node) and otherwise a
    torch.autograd.Function with the same forward (forward_fn, then setup_context(ctx, inputs, output))
    and backward_fn(ctx, *grads). Skipping the custom op's dispatch layers costs ~4 us against ~50 us
    forward with trivial bodies on CPU (~3x less forward+backward). The Function's forward is
    ctx-style because a separate setup_context makes Function.apply bind arguments by signature
    (~60 us); it is built here once, not per call."""

    class _Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            output = forward_fn(*inputs)
            setup_context(ctx, inputs, output)
            return output

        backward = staticmethod(backward_fn)

    eager = _Eager.apply

    def call(*inputs):
        return custom_op(*inputs) if torch.compiler.is_compiling() else eager(*inputs)

    return call


# torch's grouped matmul (CUTLASS) is the default on CUDA bf16: measured on an NVIDIA H200 with
# benchmarks/bench_grouped_gemm.py at T=16384, K=8, E=128 (2026-12-02), fwd+bwd, unpadded groups:
# gate_up [131072, 2048] x [128, 2048, 1536] 4.58 ms (540 TFLOP/s) vs 6.22 ms (398) for the Triton kernel;
# down [131072, 768] x [128, 768, 2048] 2.36 ms (524) vs 3.26 ms (379). The Triton kernel serves
# what torch's does not take (fp32/fp16, feature sizes not a multiple of 8) and the CPU interpreter.
USE_TORCH_GROUPED_MM = True

# pith_ops.cast keeps the cast of a trainable weight for reuse and adamw_ rewrites it (cast.py); False:
# every cast is a fresh one (the previous path, for A/B measurements).
KEEP_COPIES = True
