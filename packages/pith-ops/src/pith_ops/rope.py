"""Rotary position embedding (TEMPORARY: reference only until the Triton kernel lands)."""

import torch
from torch import Tensor


def apply_rope_reference(
    x_BSHD: Tensor, cos_BSR: Tensor, sin_BSR: Tensor, interleaved: bool = False
) -> Tensor:
    """Rotate the first 2R dims of each head (R = cos.shape[-1]); the rest pass through.
    Half-split pairs (i, i+R); interleaved pairs (2i, 2i+1). Computed in fp32, out in x.dtype."""
    R = cos_BSR.shape[-1]
    xf = x_BSHD.float()
    rot, rest = xf[..., : 2 * R], xf[..., 2 * R :]
    cos, sin = cos_BSR[:, :, None, :].float(), sin_BSR[:, :, None, :].float()
    x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., :R], rot[..., R:])
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    out = torch.stack((o1, o2), dim=-1).flatten(-2) if interleaved else torch.cat((o1, o2), dim=-1)
    return torch.cat((out, rest), dim=-1).to(x_BSHD.dtype)


apply_rope = apply_rope_reference
