"""Causal self-attention as the models call it, with the variants they need.

q [B, S, Hq, Dqk], k [B, S, Hk, Dqk], v [B, S, Hk, Dv] with Hq a multiple of Hk (GQA); masks come
from `pos.position_ids_BS` (key j is visible to query i when pos_j <= pos_i, and, with a sliding
window W, pos_i - pos_j < W), so any token order works, the zigzag order of context parallelism
included. `sinks_H` are per-head learned logits that join each softmax denominator (GPT-OSS).

`attention` picks the implementation: ring attention under context parallelism; on CUDA without
CP, PyTorch's built-in kernels, which need the local positions to run in order one step at a time
(as they do without CP), so the mask is the plain causal (or banded) triangle over indices:
- no window, no sinks: SDPA (`is_causal`, `enable_gqa`), whose flash / cuDNN kernels lead on H100;
- a window or sinks: compiled flex_attention with a cached block mask (it skips the blocks outside
  the band) returning the log-sum-exp; sinks are then applied after the fact, exactly:
  out * exp(lse) / (exp(lse) + exp(sink)) = out * sigmoid(lse - sink).
On CPU (tests, toy runs) the fp32 reference runs; it is the specification the fast paths are tested
against (tests/test_attention.py; gpu-marked where a path exists only on CUDA).
"""

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from pith_engine.attention_kernels import attention_reference, band_visible, flex_attention_lse
from pith_engine.contract import Positions
from pith_engine.ring_attention import ring_attention


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float) -> Tensor:
    """Causal attention over in-order positions with PyTorch's SDPA (any device)."""
    # enable_gqa only when the head counts differ: backends without GQA support may refuse the flag
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=True,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


@functools.lru_cache(maxsize=32)
def _band_block_mask(seq_len: int, window: int | None, device: torch.device):
    """Causal (banded when window is set) block mask over indices; the same for every layer and step."""
    from torch.nn.attention.flex_attention import create_block_mask

    def visible(b, h, q_idx, kv_idx):
        return band_visible(q_idx - kv_idx, window)

    return create_block_mask(visible, None, None, seq_len, seq_len, device=device)


def flex_attention(
    q: Tensor, k: Tensor, v: Tensor, *, scale: float, window: int | None, sinks_H: Tensor | None
) -> Tensor:
    """Causal / sliding-window attention over in-order positions with compiled flex_attention (CUDA)."""
    out, lse_BHS = flex_attention_lse(q, k, v, _band_block_mask(q.shape[1], window, q.device), scale)
    if sinks_H is None:
        return out
    keep_BHS = torch.sigmoid(lse_BHS - sinks_H.float()[None, :, None])
    return (out.float() * keep_BHS.transpose(1, 2)[..., None]).to(q.dtype)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pos: Positions,
    *,
    scale: float,
    window: int | None = None,
    sinks_H: Tensor | None = None,
) -> Tensor:
    """Causal attention over the local sequence (ring attention across `pos.cp_group` when set)."""
    if pos.cp_group is not None:
        return ring_attention(q, k, v, pos, scale=scale, window=window, sinks_H=sinks_H)
    if q.is_cuda and window is None and sinks_H is None:
        return sdpa_attention(q, k, v, scale=scale)
    # flex's Triton kernels need head dims of at least 16 (tl.dot); smaller ones are toy models
    if q.is_cuda and min(q.shape[-1], v.shape[-1]) >= 16:
        return flex_attention(q, k, v, scale=scale, window=window, sinks_H=sinks_H)
    p = pos.position_ids_BS
    return attention_reference(q, k, v, p, p, scale=scale, window=window, sinks_H=sinks_H)[0]
