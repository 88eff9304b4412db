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

from pith_engine.contract import Positions


def attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pos_q_BS: Tensor,
    pos_k_BS: Tensor,
    *,
    scale: float,
    window: int | None = None,
    sinks_H: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Plain-PyTorch attention in fp32 (fp64 for fp64 inputs): returns (out [B, Sq, Hq, Dv] in q's
    dtype, lse [B, Hq, Sq] in that compute dtype).

    lse is the log-sum-exp of the scaled, masked scores over the keys given (sinks excluded), the
    quantity ring attention merges partial results by. A query that sees no key gets out 0, lse -inf.
    """
    B, Sq, Hq, _ = q.shape
    Hk = k.shape[2]
    compute = torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf = (t.to(compute).transpose(1, 2) for t in (q, k, v))
    kf = kf.repeat_interleave(Hq // Hk, dim=1)
    vf = vf.repeat_interleave(Hq // Hk, dim=1)
    scores = (qf @ kf.transpose(-1, -2)) * scale  # [B, H, Sq, Sk]
    visible = band_visible(pos_q_BS[:, None, :, None] - pos_k_BS[:, None, None, :], window)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    denom = lse if sinks_H is None else torch.logaddexp(lse, sinks_H.to(compute)[None, :, None])
    probs = torch.exp(scores - denom.nan_to_num(neginf=0.0)[..., None])
    out = (probs @ vf).transpose(1, 2).to(q.dtype)
    return out, lse


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


def band_visible(dist: Tensor, window: int | None) -> Tensor:
    """Whether a query sees a key dist = q_pos - k_pos ahead of it: causal, banded when window is set."""
    return (dist >= 0) & (dist < window) if window is not None else dist >= 0


_FP32_BLOCKS = ("BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2")


@functools.cache
def _compiled_flex_attention():
    # imported on first use: flex_attention's import costs about half of torch's own
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


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


def flex_attention_lse(q: Tensor, k: Tensor, v: Tensor, block_mask, scale: float) -> tuple[Tensor, Tensor]:
    """Compiled flex_attention of [B, S, H, D] tensors under block_mask (GQA allowed) ->
    (out [B, Sq, Hq, Dv] in q's dtype, lse [B, Hq, Sq] fp32)."""
    from torch.nn.attention.flex_attention import AuxRequest  # here: flex's import is slow, CUDA-only

    out_BHSD, aux = _compiled_flex_attention()(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        block_mask=block_mask,
        scale=scale,
        enable_gqa=True,
        return_aux=AuxRequest(lse=True),
        # fp32 tiles at flex's default block sizes overflow shared memory for head dims above 128 (MLA's
        # 192): 32-row blocks fit every head dim here; bf16 keeps the tuned defaults.
        kernel_options=dict.fromkeys(_FP32_BLOCKS, 32) if q.dtype == torch.float32 else None,
    )
    return out_BHSD.transpose(1, 2), aux.lse


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
        from pith_engine.ring_attention import ring_attention  # imported here: it builds on this module

        return ring_attention(q, k, v, pos, scale=scale, window=window, sinks_H=sinks_H)
    if q.is_cuda and window is None and sinks_H is None:
        return sdpa_attention(q, k, v, scale=scale)
    # flex's Triton kernels need head dims of at least 16 (tl.dot); smaller ones are toy models
    if q.is_cuda and min(q.shape[-1], v.shape[-1]) >= 16:
        return flex_attention(q, k, v, scale=scale, window=window, sinks_H=sinks_H)
    p = pos.position_ids_BS
    return attention_reference(q, k, v, p, p, scale=scale, window=window, sinks_H=sinks_H)[0]
