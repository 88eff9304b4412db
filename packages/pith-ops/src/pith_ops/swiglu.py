"""SwiGLU (TEMPORARY: reference only until the Triton kernel lands)."""

import torch
import torch.nn.functional as F
from torch import Tensor


def swiglu_reference(x_N2F: Tensor) -> Tensor:
    """silu(gate) * up with gate = x[..., :F], up = x[..., F:]."""
    gate, up = x_N2F.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_oss_reference(x_N2F: Tensor, alpha: float = 1.702, limit: float = 7.0) -> Tensor:
    """GPT-OSS: gate = x[..., ::2].clamp(max=limit), up = x[..., 1::2].clamp(-limit, limit),
    out = gate * sigmoid(alpha * gate) * (up + 1)."""
    gate = x_N2F[..., ::2].clamp(max=limit)
    up = x_N2F[..., 1::2].clamp(-limit, limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


swiglu = swiglu_reference
swiglu_oss = swiglu_oss_reference
