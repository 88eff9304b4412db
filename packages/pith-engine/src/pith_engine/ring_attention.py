"""Context parallelism: ring attention over a zigzag split of the sequence.

Layout. Rank r keeps chunks r and 2cp-1-r of 2*cp, one early and one late, so the causal work is the
same on every rank (cp=2, L=8: rank 0 holds positions 0 1 6 7).

Forward. K/V and their positions travel around the ring: at step s rank r holds the block of rank
(r - s) mod cp, sending it on while it computes with it. Which (query chunk, key chunk) pairs can see
each other follows from the chunk indices alone, so fully masked pairs are skipped without a host
sync (documents, in order, only hide more); inside a pair the mask comes from the positions and
document ids. Partial results merge by log-sum-exp in fp32; sinks join only the final denominator,
after the merge: out * sigmoid(lse - sink).

Backward. The ring runs again, dK/dV accumulators one step behind K/V (their transfer overlaps the
next block's compute). With out = sum_b w_b out_b, w_b = exp(lse_b - lse), a block's outputs receive
d out_b = dout * w_b and d lse_b = w_b * (dout.out_b - dout.out); each block is recomputed and
backpropagated with those, exactly (~one more block forward per block backward; flex_attention
has no public backward taking a given out and lse). Sinks: d sink = -sum exp(sink - lse) dout.out.

Shape legend: B batch, S local sequence (two chunks of C), L full sequence, H heads (Hq query,
Hk key/value), D head dims (Dqk, Dv).
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from pith_engine.attention_kernels import (
    attention_reference,
    band_visible,
    compiled_create_block_mask,
    flex_attention_lse,
    flex_fits,
)
from pith_engine.contract import Positions


def zigzag_split(t: Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> Tensor:
    """This rank's share of `t` along `dim`: chunks cp_rank and 2*cp_size-1-cp_rank of 2*cp_size."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"expected cp_size >= 1 and 0 <= cp_rank < cp_size, got {cp_size=} {cp_rank=}")
    if (S := t.shape[dim]) % (2 * cp_size):
        raise ValueError(f"sequence length {S} is not divisible by 2*cp = {2 * cp_size} (zigzag chunks)")
    chunks = t.chunk(2 * cp_size, dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim)


def ring_schedule(
    cp_size: int, cp_rank: int, chunk_len: int, window: int | None
) -> list[list[tuple[int, slice]]]:
    """For each ring step: (local query chunk 0 or 1, key rows of the visiting block) for every query
    chunk that sees any of its keys."""
    q_chunks = (cp_rank, 2 * cp_size - 1 - cp_rank)
    steps = []
    for s in range(cp_size):
        src = (cp_rank - s) % cp_size
        k_chunks = (src, 2 * cp_size - 1 - src)
        pairs = []
        for i, a in enumerate(q_chunks):
            # the closest pair of chunk a and earlier chunk b is (a - b - 1) * chunk_len + 1 apart
            seen = [
                j
                for j, b in enumerate(k_chunks)
                if b <= a and (window is None or (a - b - 1) * chunk_len + 1 < window)
            ]
            if seen:
                pairs.append((i, slice(seen[0] * chunk_len, (seen[-1] + 1) * chunk_len)))
        steps.append(pairs)
    return steps


def _block_attention(q, k, v, pos_q_BS, pos_k_BS, doc_q_BS, doc_k_BS, scale, window):
    """-> (out [B, Sq, Hq, Dv] in q's dtype, lse [B, Hq, Sq] fp32 or fp64)."""
    if not flex_fits(q, v):
        docs = (doc_q_BS, doc_k_BS)
        return attention_reference(q, k, v, pos_q_BS, pos_k_BS, scale=scale, window=window, docs=docs)

    def visible(b, h, qi, ki):
        same = doc_q_BS[b, qi] == doc_k_BS[b, ki]
        return band_visible(pos_q_BS[b, qi] - pos_k_BS[b, ki], window) & same

    B, Sq, Sk = q.shape[0], q.shape[1], k.shape[1]
    block_mask = compiled_create_block_mask()(visible, B, None, Sq, Sk, device=q.device)
    return flex_attention_lse(q, k, v, block_mask, scale)


def _block_backward(q, k, v, pos_doc: tuple[Tensor, ...], dout, lse_BHS, dot_BHS, scale, window):
    """(dq, dk, dv) of one block's share of the merged output (module docstring); lse_BHS: the merged
    lse, dot_BHS = rowsum(dout * out); pos_doc: (pos_q, pos_k, doc_q, doc_k)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with torch.enable_grad():
        out_b, lse_b = _block_attention(q, k, v, *pos_doc, scale, window)
    w_BHS = torch.exp(lse_b.detach() - lse_BHS)  # 0 where the block hid every key from a query
    dout = dout.to(lse_BHS.dtype)
    d_out_b = (dout * w_BHS.transpose(1, 2)[..., None]).to(out_b.dtype)
    d_lse_b = w_BHS * ((dout * out_b.detach().to(lse_BHS.dtype)).sum(-1).transpose(1, 2) - dot_BHS)
    return torch.autograd.grad((out_b, lse_b), (q, k, v), (d_out_b, d_lse_b))


def _ring_shift(tensors: tuple[Tensor, ...], group: ProcessGroup) -> Callable[[], tuple[Tensor, ...]]:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size == 1:
        return lambda: tensors
    nxt = dist.get_global_rank(group, (rank + 1) % size)
    prv = dist.get_global_rank(group, (rank - 1) % size)
    sent = [t.contiguous() for t in tensors]
    received = tuple(torch.empty_like(t) for t in sent)
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in sent]
    ops += [dist.P2POp(dist.irecv, t, prv, group) for t in received]
    works = dist.batch_isend_irecv(ops)

    def finish() -> tuple[Tensor, ...]:
        for w in works:
            w.wait()
        return received

    return finish


def _merge(out_a, lse_a, out_b, lse_b):
    """Log-sum-exp merge of two partial results over disjoint keys (lse_a finite), in lse's dtype."""
    if out_a is None:
        return out_b.to(lse_b.dtype), lse_b
    lse = torch.logaddexp(lse_a, lse_b)
    w_a, w_b = (torch.exp(x - lse).transpose(1, 2)[..., None] for x in (lse_a, lse_b))
    return out_a * w_a + out_b.to(lse.dtype) * w_b, lse


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks_H, pos_BS, doc_BS, scale, window, group):
        cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
        C = q.shape[1] // 2
        schedule = ring_schedule(cp_size, cp_rank, C, window)
        out_parts, lse_parts = [None, None], [None, None]  # per local query chunk
        blk = (k, v, pos_BS, doc_BS)
        for s, pairs in enumerate(schedule):
            arriving = _ring_shift(blk, group) if s + 1 < cp_size else None
            k_blk, v_blk, pos_blk, doc_blk = blk
            for i, ks in pairs:  # step 0 (own block) covers both chunks, so the merges see finite lse
                qs = slice(i * C, (i + 1) * C)
                pos_doc = (pos_BS[:, qs], pos_blk[:, ks], doc_BS[:, qs], doc_blk[:, ks])
                o, l = _block_attention(q[:, qs], k_blk[:, ks], v_blk[:, ks], *pos_doc, scale, window)
                out_parts[i], lse_parts[i] = _merge(out_parts[i], lse_parts[i], o, l)
            if arriving is not None:
                blk = arriving()
        out, lse_BHS = torch.cat(out_parts, 1), torch.cat(lse_parts, 2)
        if sinks_H is not None:
            with_sink = torch.logaddexp(lse_BHS, sinks_H.to(lse_BHS.dtype)[None, :, None])
            out = out * torch.exp(lse_BHS - with_sink).transpose(1, 2)[..., None]
            lse_BHS = with_sink
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, sinks_H, pos_BS, doc_BS, out, lse_BHS)
        ctx.scale, ctx.window, ctx.group, ctx.schedule = scale, window, group, schedule
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, sinks_H, pos_BS, doc_BS, out, lse_BHS = ctx.saved_tensors
        scale, window, group, schedule = ctx.scale, ctx.window, ctx.group, ctx.schedule
        C = q.shape[1] // 2
        acc = lse_BHS.dtype  # fp32 (fp64 for fp64 inputs), as the block kernel's lse
        dot_BHS = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)
        dq = torch.zeros_like(q, dtype=acc)
        blk, dkv_arriving = (k, v, pos_BS, doc_BS), None
        for s, pairs in enumerate(schedule):
            arriving = _ring_shift(blk, group) if s + 1 < len(schedule) else None
            k_blk, v_blk, pos_blk, doc_blk = blk
            dk_blk, dv_blk = torch.zeros_like(k_blk, dtype=acc), torch.zeros_like(v_blk, dtype=acc)
            for i, ks in pairs:
                qs = slice(i * C, (i + 1) * C)
                pos_doc = (pos_BS[:, qs], pos_blk[:, ks], doc_BS[:, qs], doc_blk[:, ks])
                gq, gk, gv = _block_backward(
                    q[:, qs], k_blk[:, ks], v_blk[:, ks], pos_doc,
                    dout[:, qs], lse_BHS[..., qs], dot_BHS[..., qs], scale, window,
                )  # fmt: skip
                dq[:, qs] += gq
                dk_blk[:, ks] += gk
                dv_blk[:, ks] += gv
            if dkv_arriving is not None:  # what earlier ranks accumulated for this same block
                dk_prev, dv_prev = dkv_arriving()
                dk_blk += dk_prev
                dv_blk += dv_prev
            dkv_arriving = _ring_shift((dk_blk, dv_blk), group)
            if arriving is not None:
                blk = arriving()
        dk, dv = dkv_arriving()  # after cp shifts each block's accumulator is back at its owner
        dsinks = None
        if sinks_H is not None:
            dsinks = -(torch.exp(sinks_H.to(acc)[None, :, None] - lse_BHS) * dot_BHS).sum((0, 2))
            dsinks = dsinks.to(sinks_H.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None, None, None, None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pos: Positions,
    *,
    scale: float,
    window: int | None = None,
    sinks_H: Tensor | None = None,
) -> Tensor:
    """Causal attention of this rank's zigzag share over the whole sequence, ring over `pos.cp_group`;
    pos.position_ids_BS: the local tokens' global positions (zigzag_split of arange). -> [B, S, Hq, Dv]."""
    B, S, Hq, Dqk = q.shape
    if k.shape[:2] != (B, S) or k.shape[3] != Dqk or v.shape[:3] != k.shape[:3] or Hq % k.shape[2]:
        raise ValueError(
            f"expected q [B, S, Hq, Dqk], k [B, S, Hk, Dqk], v [B, S, Hk, Dv] with Hq a multiple of Hk, "
            f"got q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}"
        )
    if tuple(pos.position_ids_BS.shape) != (B, S):
        raise ValueError(f"expected position ids [B, S] = {[B, S]}, got {list(pos.position_ids_BS.shape)}")
    if S % 2:
        raise ValueError(f"expected an even local sequence length (two zigzag chunks), got {S}")
    if window is not None and window < 1:
        raise ValueError(f"expected a sliding window of at least 1, got {window}")
    if sinks_H is not None and tuple(sinks_H.shape) != (Hq,):
        raise ValueError(f"expected sinks of shape [{Hq}] (one per query head), got {list(sinks_H.shape)}")
    p = pos.position_ids_BS
    doc_BS = torch.zeros_like(p) if pos.doc_BS is None else pos.doc_BS
    return _RingAttention.apply(q, k, v, sinks_H, p, doc_BS, scale, window, pos.cp_group)
