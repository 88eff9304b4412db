"""Helpers shared by the operators; the A/B switches live here as the functions grouped_gemm and cast
shadow their modules' names."""

import functools
import os
from collections.abc import Callable

import torch
from torch import Tensor

# Triton runs on CPU tensors only under its interpreter (how CI tests kernels).
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


def eager_or_custom(custom_op, setup_context, forward_fn, grads, op_backward, eager_backward) -> Callable:
    """Registers grads(op_backward, ctx, *dy) as custom_op's autograd -> custom_op under torch.compile,
    else an autograd.Function (~4 us a call against ~50, CPU) whose backward is grads(eager_backward, ..).
    Its forward is ctx-style: a separate setup_context makes apply bind arguments by signature (~60 us)."""
    custom_op.register_autograd(functools.partial(grads, op_backward), setup_context=setup_context)

    class _Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            output = forward_fn(*inputs)
            setup_context(ctx, inputs, output)
            return output

        backward = staticmethod(functools.partial(grads, eager_backward))

    eager = _Eager.apply
    return lambda *inputs: custom_op(*inputs) if torch.compiler.is_compiling() else eager(*inputs)


# torch's grouped matmul where it applies (faster than the Triton kernel: README). False: A/B runs.
USE_TORCH_GROUPED_MM = True

# False: every pith_ops.cast is a fresh one, nothing kept (A/B runs).
KEEP_COPIES = True
