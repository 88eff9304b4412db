"""Input checks and the kernel-or-reference decision shared by the operators."""

import os

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
