"""Expert parallelism: stages 2 and 4 as all-to-all exchanges over the EP group, deduplicated.

EP rank r of R holds the global experts [r*El, (r+1)*El), El = E / R. Dispatch sends each token once
to every rank that holds any of its top-k experts (not once per expert), with a row of routing
metadata (its combine weights and local expert ids for that rank, -1 elsewhere); the receiver
expands the rows over its local experts with pith_ops.moe_permute. Combine mirrors it: the receiver
forms, per received row, the weighted sum over its experts (pith_ops.moe_unpermute) and sends one
row back; stage 5 on the source adds its <= R returned rows with weight 1 (slots, slot -1 = no row).
The routing weights travel through the exchange, so their gradient (and x's) flows back through it.

Host synchronisations per MoE layer: exactly one, in dispatch (one D2H copy of the exchanged row
and pair counts: all_to_all_single needs its split sizes on the host). Combine and the backward of
both reuse those sizes: no sync. Collectives: 4 all-to-alls forward (counts, rows, metadata,
combine), 3 backward. Index building uses torch device ops (cumsum, scatter), O(T*R + M*K) int work,
negligible beside the D-wide row exchange it serves; none of it needs a host sync.

Shape legend: T local tokens, K top-k, D model dim, R EP ranks, El experts per rank, S rows sent
(one per (token, destination)), M rows received, P (row, expert) pairs received, N grouped rows.
"""

from typing import Any, NamedTuple

import pith_ops
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from pith_engine.contract import Routing


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        out_splits, in_splits = ctx.splits
        dx = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(dx, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return dx, None, None, None


def _true_positions(mask: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """-> (indices of the True entries of a flat mask, in order, [count]; each entry's rank among them,
    -1 where False). `count` (the number of True entries) comes from the host, so no sync here."""
    rank = torch.cumsum(mask, 0) - 1
    # False entries write into a sink slot at index `count`, cut off afterwards.
    target = torch.where(mask, rank, count)
    idx = torch.zeros(count + 1, dtype=torch.long, device=mask.device)
    idx.scatter_(0, target, torch.arange(mask.numel(), device=mask.device))
    return idx[:count], torch.where(mask, rank, -1)


class _Handle(NamedTuple):
    slots_MK: Tensor  # receiver: grouped row of each (received row, k), -1 where not a local expert
    weights_MK: Tensor  # receiver: combine weights of those entries (0 where not local), with grad
    slots_TR: Tensor  # source: returned row of (token, rank), -1 where nothing went to that rank
    send_rows: list[int]
    recv_rows: list[int]


class ExpertParallel:
    """Stages 2 and 4 across an EP group; this rank holds experts [rank*El, (rank+1)*El)."""

    def __init__(self, group: ProcessGroup, align: int = 1):
        self.group, self.ranks, self.align = group, dist.get_world_size(group), align

    def dispatch(self, r: Routing) -> tuple[Tensor, Tensor, Any]:
        T, K = r.expert_ids_TK.shape
        E, R, dev = r.probs_TE.shape[-1], self.ranks, r.x_TD.device
        if E % R:
            raise ValueError(f"expert parallelism: {E} experts do not divide over ep={R} ranks")
        El = E // R
        dest_TK = r.expert_ids_TK // El
        # A one-hot [R, T, K] (small: R*T*K bools), not an index_put of True, whose scalar is a host copy.
        hit_RTK = dest_TK[None] == torch.arange(R, device=dev)[:, None, None]
        need_RT = hit_RTK.any(2)
        send_counts_R2 = torch.stack([need_RT.sum(1), hit_RTK.sum((1, 2))], 1)
        recv_counts_R2 = torch.empty_like(send_counts_R2)
        dist.all_to_all_single(recv_counts_R2, send_counts_R2, group=self.group)
        # The layer's one host sync: split sizes for the exchanges (and the pair count for shapes).
        counts = torch.cat([send_counts_R2[:, 0], recv_counts_R2.flatten()]).tolist()
        send_rows, recv_rows, recv_pairs = counts[:R], counts[R::2], sum(counts[R + 1 :: 2])

        # Source: one row per (destination, token) in that order, its metadata, its return slot.
        sent_S, slot_RT = _true_positions(need_RT.flatten(), sum(send_rows))
        dst_S, tok_S = sent_S // T, sent_S % T
        mine_SK = dest_TK[tok_S] == dst_S[:, None]
        weights_SK = torch.where(mine_SK, r.weights_TK[tok_S], 0.0)
        local_SK = torch.where(mine_SK, r.expert_ids_TK[tok_S] - dst_S[:, None] * El, -1)
        # Weights and ids share one fp32 exchange (ids < 2^24 are exact in fp32).
        meta_S2K = torch.cat([weights_SK.float(), local_SK.float()], 1)
        x_MD = _AllToAll.apply(r.x_TD[tok_S], recv_rows, send_rows, self.group)
        meta_M2K = _AllToAll.apply(meta_S2K, recv_rows, send_rows, self.group)

        # Receiver: expand the received rows over this rank's experts.
        weights_MK, local_MK = meta_M2K[:, :K], meta_M2K[:, K:].detach().long()
        pair_P, _ = _true_positions((local_MK >= 0).flatten(), recv_pairs)
        x_ND, slots_P1, group_ends_E = pith_ops.moe_permute(
            x_MD[pair_P // K], local_MK.flatten()[pair_P, None], El, self.align
        )
        slots_MK = torch.full((local_MK.numel(),), -1, dtype=torch.long, device=dev)
        slots_MK = slots_MK.index_copy_(0, pair_P, slots_P1.view(-1)).view(local_MK.shape)
        handle = _Handle(slots_MK, weights_MK, slot_RT.view(R, T).T, send_rows, recv_rows)
        return x_ND, group_ends_E, handle

    def combine(self, y_ND: Tensor, handle: Any) -> tuple[Tensor, Tensor, Tensor]:
        h: _Handle = handle
        partial_MD = pith_ops.moe_unpermute(y_ND, h.slots_MK, h.weights_MK)
        rows_SD = _AllToAll.apply(partial_MD, h.send_rows, h.recv_rows, self.group)
        return rows_SD, h.slots_TR, torch.ones(h.slots_TR.shape, dtype=torch.float32, device=y_ND.device)
