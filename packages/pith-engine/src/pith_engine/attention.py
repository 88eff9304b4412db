"""Causal self-attention as the models call it: q [B, S, Hq, Dqk], k [B, S, Hk, Dqk], v [B, S, Hk, Dv]
(GQA), an optional sliding window and per-head sinks (logits joining each softmax denominator).

`attention` picks the implementation: ring attention under context parallelism; on CUDA without CP,
where local positions run in order, the causal (or banded) triangle over indices:
- no window, no sinks: SDPA, whose flash / cuDNN kernels lead on H100;
- a window or sinks: compiled flex_attention with a cached block mask (it skips the blocks outside
  the band), sinks applied after the fact, exactly: out * sigmoid(lse - sink).
Document ids (pos.doc_BS): flex, its mask cached per micro-batch. On CPU the fp32 reference runs,
the specification the fast paths are tested against.
"""

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from pith_engine.attention_kernels import (
    attention_reference,
    band_visible,
    compiled_create_block_mask,
    flex_attention_lse,
    flex_fits,
)
from pith_engine.contract import Positions
from pith_engine.ring_attention import ring_attention


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float) -> Tensor:
    # enable_gqa only when the head counts differ: backends without GQA may refuse the flag
    qkv = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        *qkv, is_causal=True, scale=scale, enable_gqa=q.shape[2] != k.shape[2]
    )
    return out.transpose(1, 2)


@functools.lru_cache(maxsize=32)
def _band_block_mask(seq_len: int, window: int | None, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    visible = lambda b, h, q_idx, kv_idx: band_visible(q_idx - kv_idx, window)
    return create_block_mask(visible, None, None, seq_len, seq_len, device=device)


@functools.lru_cache(maxsize=32)
def _document_block_mask(doc_BS: Tensor, window: int | None):
    # keyed by the ids tensor (the cache keeps it alive): a micro-batch's layers share one mask
    def visible(b, h, q_idx, kv_idx):
        return band_visible(q_idx - kv_idx, window) & (doc_BS[b, q_idx] == doc_BS[b, kv_idx])

    B, S = doc_BS.shape
    return compiled_create_block_mask()(visible, B, None, S, S, device=doc_BS.device)


def flex_attention(q: Tensor, k: Tensor, v: Tensor, doc_BS, *, scale: float, window, sinks_H) -> Tensor:
    S = q.shape[1]
    mask = _band_block_mask(S, window, q.device) if doc_BS is None else _document_block_mask(doc_BS, window)
    out, lse_BHS = flex_attention_lse(q, k, v, mask, scale)
    if sinks_H is None:
        return out
    keep_BHS = torch.sigmoid(lse_BHS - sinks_H.float()[None, :, None])
    return (out.float() * keep_BHS.transpose(1, 2)[..., None]).to(q.dtype)


def attention(
    q: Tensor, k: Tensor, v: Tensor, pos: Positions, *, scale: float, window: int | None = None,
    sinks_H: Tensor | None = None, reference: bool = False,
) -> Tensor:  # fmt: skip
    """reference: the fp32 reference on any device (a model's reference_forward)."""
    if pos.cp_group is not None and not reference:
        return ring_attention(q, k, v, pos, scale=scale, window=window, sinks_H=sinks_H)
    fast, doc = q.is_cuda and not reference, pos.doc_BS
    if fast and window is None and sinks_H is None and doc is None:
        return sdpa_attention(q, k, v, scale=scale)
    if fast and flex_fits(q, v):
        return flex_attention(q, k, v, doc, scale=scale, window=window, sinks_H=sinks_H)
    p, docs = pos.position_ids_BS, None if doc is None else (doc, doc)
    return attention_reference(q, k, v, p, p, scale=scale, window=window, sinks_H=sinks_H, docs=docs)[0]
