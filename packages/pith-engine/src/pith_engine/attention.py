"""Causal self-attention as the models call it, with the variants they need.

q [B, S, Hq, Dqk], k [B, S, Hk, Dqk], v [B, S, Hk, Dv] with Hq a multiple of Hk (GQA); masks come
from `pos.position_ids_BS` (key j is visible to query i when pos_j <= pos_i, and, with a sliding
window W, pos_i - pos_j < W), so any token order works, the zigzag order of context parallelism
included. `sinks_H` are per-head learned logits that join each softmax denominator (GPT-OSS).
"""

import torch
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
    """Plain-PyTorch attention in fp32: returns (out [B, Sq, Hq, Dv] in q's dtype, lse [B, Hq, Sq] fp32).

    lse is the log-sum-exp of the scaled, masked scores over the keys given (sinks excluded), the
    quantity ring attention merges partial results by. A query that sees no key gets out 0, lse -inf.
    """
    B, Sq, Hq, _ = q.shape
    Hk = k.shape[2]
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    kf = kf.repeat_interleave(Hq // Hk, dim=1)
    vf = vf.repeat_interleave(Hq // Hk, dim=1)
    scores = (qf @ kf.transpose(-1, -2)) * scale  # [B, H, Sq, Sk]
    dist = pos_q_BS[:, None, :, None] - pos_k_BS[:, None, None, :]
    visible = dist >= 0
    if window is not None:
        visible = visible & (dist < window)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    denom = lse if sinks_H is None else torch.logaddexp(lse, sinks_H.float()[None, :, None])
    probs = torch.exp(scores - denom.nan_to_num(neginf=0.0)[..., None])
    out = (probs @ vf).transpose(1, 2).to(q.dtype)
    return out, lse


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
    p = pos.position_ids_BS
    return attention_reference(q, k, v, p, p, scale=scale, window=window, sinks_H=sinks_H)[0]
