"""RMSNorm (TEMPORARY: reference only until the Triton kernel lands)."""

import torch
from torch import Tensor


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float, unit_offset: bool = False) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * w (or * (1 + w) with unit_offset), computed in fp32, out in x.dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float() + 1.0 if unit_offset else weight.float()
    return (y * w).to(x.dtype)


rms_norm = rms_norm_reference
