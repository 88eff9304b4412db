"""Expert parallelism: stages 2 and 4 as all-to-all exchanges over the EP group, deduplicated.

EP rank r of R holds the global experts [r*El, (r+1)*El), El = E / R. Dispatch sends each token once
to every rank that holds any of its top-k experts (not once per expert), with a row of routing
metadata (its combine weights and global expert ids, the same for every destination); the receiver
expands the rows over its local experts with pith_ops.moe_permute. Combine mirrors it: the receiver
forms, per received row, the weighted sum over its experts (pith_ops.moe_unpermute) and sends one
row back; stage 5 on the source adds its <= R returned rows with weight 1 (slots, slot -1 = no row).
The routing weights travel through the exchange, so their gradient (and x's) flows back through it.

Host synchronisations per MoE layer: exactly one, in dispatch (one D2H copy of the exchanged row
and pair counts: all_to_all_single needs its split sizes on the host). Combine and the backward of
both reuse those sizes: no sync. Collectives: 4 all-to-alls forward (counts, rows, metadata,
combine), 3 backward. The indices come from pith_ops.moe_permute (Triton on the GPU), in the pass
that copies the rows: on the source, rows grouped by destination rank (id -1 where a token skips a
rank) are the all-to-all's send layout; on the receiver, ids outside this rank's experts are -1. The
counts from the one sync give both calls their static row counts.

Shape legend: T local tokens, K top-k, D model dim, R EP ranks, El experts per rank, S rows sent
(one per (token, destination)), M rows received, N grouped rows.
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


class _Handle(NamedTuple):
    slots_MK: Tensor  # receiver: grouped row of each (received row, k), -1 where not a local expert
    weights_MK: Tensor  # receiver: combine weights of those entries (used where slots_MK >= 0), with grad
    slots_TR: Tensor  # source: returned row of (token, rank), -1 where nothing went to that rank
    send_rows: list[int]
    recv_rows: list[int]


class ExpertParallel:
    """Stages 2 and 4 across an EP group; this rank holds experts [rank*El, (rank+1)*El)."""

    def __init__(self, group: ProcessGroup, align: int = 1):
        self.group, self.ranks, self.align = group, dist.get_world_size(group), align
        self.rank = dist.get_rank(group)

    def dispatch(self, r: Routing) -> tuple[Tensor, Tensor, Any]:
        K = r.expert_ids_TK.shape[1]
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

        # Source: "expert" r of token t is destination rank r (-1: not sent there), so moe_permute lays
        # the rows out by destination, token order within: the send layout. slots_TR is where each
        # (token, rank) row went, and so where it comes back in combine.
        S = sum(send_rows)
        dest_TR = torch.where(need_RT.T, torch.arange(R, device=dev), -1)
        x_SD, slots_TR, _ = pith_ops.moe_permute(r.x_TD, dest_TR, R, rows=S)
        # Weights and global ids share one fp32 permute and exchange (ids < 2^24 are exact in fp32);
        # its gradient carries the weights' back.
        meta_T2K = torch.cat([r.weights_TK.float(), r.expert_ids_TK.float()], 1)
        meta_S2K, _, _ = pith_ops.moe_permute(meta_T2K, dest_TR, R, rows=S)
        x_MD = _AllToAll.apply(x_SD, recv_rows, send_rows, self.group)
        meta_M2K = _AllToAll.apply(meta_S2K, recv_rows, send_rows, self.group)

        # Receiver: expand the received rows over this rank's experts; other experts' entries get slot
        # -1, which moe_unpermute skips (and gives a zero weight gradient).
        weights_MK = meta_M2K[:, :K]
        local_MK = meta_M2K[:, K:].detach().long() - self.rank * El
        local_MK = torch.where((local_MK >= 0) & (local_MK < El), local_MK, -1)
        x_ND, slots_MK, group_ends_E = pith_ops.moe_permute(
            x_MD, local_MK, El, self.align, rows=recv_pairs + El * (self.align - 1)
        )
        return x_ND, group_ends_E, _Handle(slots_MK, weights_MK, slots_TR, send_rows, recv_rows)

    def combine(self, y_ND: Tensor, handle: Any) -> tuple[Tensor, Tensor, Tensor]:
        h: _Handle = handle
        partial_MD = pith_ops.moe_unpermute(y_ND, h.slots_MK, h.weights_MK)
        rows_SD = _AllToAll.apply(partial_MD, h.send_rows, h.recv_rows, self.group)
        return rows_SD, h.slots_TR, torch.ones(h.slots_TR.shape, dtype=torch.float32, device=y_ND.device)
