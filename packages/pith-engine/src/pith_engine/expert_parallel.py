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


class Pending:
    """An all-to-all in flight (issued with async_op=True); wait() -> its output.

    On CUDA, NCCL runs it on the process group's own stream, which waits (by a CUDA event) for the
    work issued so far on the current stream; wait() makes the current stream wait for it in turn,
    without blocking the host. On CPU, gloo runs it on its own thread and wait() blocks until done.
    One code path for both: compute issued between start and wait overlaps the exchange."""

    def __init__(self, x: Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup):
        self.out = x.new_empty(sum(out_splits), *x.shape[1:])
        self.x = x.contiguous()  # kept alive until the exchange is done
        self.work = dist.all_to_all_single(self.out, self.x, out_splits, in_splits, group, async_op=True)

    def wait(self) -> Tensor:
        self.work.wait()
        return self.out


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return Pending(x, out_splits, in_splits, group).wait()

    @staticmethod
    def backward(ctx, grad: Tensor):
        out_splits, in_splits = ctx.splits
        return Pending(grad, in_splits, out_splits, ctx.group).wait(), None, None, None


class Plan(NamedTuple):
    """Split sizes of one MoE layer's exchanges, on the host (the layer's one host sync)."""

    send_rows: list[int]  # rows this rank sends to each EP rank (dispatch; received back in combine)
    recv_rows: list[int]  # rows it receives from each
    recv_pairs: int  # (received row, local expert) pairs: the grouped rows before padding


class Counts(NamedTuple):
    """Dispatch's first exchange in flight: per destination (tokens, pairs), sent and received."""

    need_RT: Tensor  # bool: token t goes to rank r
    send_counts_R2: Tensor
    recv: Pending


class _Handle(NamedTuple):
    slots_MK: Tensor  # receiver: grouped row of each (received row, k), -1 where not a local expert
    weights_MK: Tensor  # receiver: combine weights of those entries (used where slots_MK >= 0), with grad
    slots_TR: Tensor  # source: returned row of (token, rank), -1 where nothing went to that rank
    send_rows: list[int]
    recv_rows: list[int]


class ExpertParallel:
    """Stages 2 and 4 across an EP group; this rank holds experts [rank*El, (rank+1)*El).

    dispatch and combine are the whole stages. A schedule that overlaps them with another
    micro-batch's compute runs their pieces instead, the exchanges in between issued and waited
    apart (`Pending`): counts -> plan (the host sync) -> send_layout -> exchange rows and
    metadata -> receive; combine: partial_rows -> exchange back."""

    def __init__(self, group: ProcessGroup, align: int = 1):
        self.group, self.ranks, self.align = group, dist.get_world_size(group), align
        self.rank = dist.get_rank(group)

    def counts(self, r: Routing) -> Counts:
        """Issue the exchange of per-destination (token, pair) counts; stage 1's router output suffices."""
        E, R, dev = r.probs_TE.shape[-1], self.ranks, r.x_TD.device
        if E % R:
            raise ValueError(f"expert parallelism: {E} experts do not divide over ep={R} ranks")
        dest_TK = r.expert_ids_TK // (E // R)
        # A one-hot [R, T, K] (small: R*T*K bools), not an index_put of True, whose scalar is a host copy.
        hit_RTK = dest_TK[None] == torch.arange(R, device=dev)[:, None, None]
        need_RT = hit_RTK.any(2)
        send_counts_R2 = torch.stack([need_RT.sum(1), hit_RTK.sum((1, 2))], 1)
        return Counts(need_RT, send_counts_R2, Pending(send_counts_R2, [1] * R, [1] * R, self.group))

    def plan(self, c: Counts) -> Plan:
        """Wait for the counts: the layer's one host sync (all_to_all_single needs its split sizes on
        the host, and the receiver's row count gives moe_permute a static shape)."""
        R = self.ranks
        counts = torch.cat([c.send_counts_R2[:, 0], c.recv.wait().flatten()]).tolist()
        return Plan(counts[:R], counts[R::2], sum(counts[R + 1 :: 2]))

    def send_layout(self, r: Routing, need_RT: Tensor, p: Plan) -> tuple[Tensor, Tensor, Tensor]:
        """-> (rows x_SD, metadata meta_S2K, slots_TR) in the all-to-all's send layout."""
        # Source: "expert" r of token t is destination rank r (-1: not sent there), so moe_permute lays
        # the rows out by destination, token order within: the send layout. slots_TR is where each
        # (token, rank) row went, and so where it comes back in combine.
        R, S = self.ranks, sum(p.send_rows)
        dest_TR = torch.where(need_RT.T, torch.arange(R, device=need_RT.device), -1)
        x_SD, slots_TR, _ = pith_ops.moe_permute(r.x_TD, dest_TR, R, rows=S)
        # Weights and global ids share one fp32 permute and exchange (ids < 2^24 are exact in fp32);
        # its gradient carries the weights' back.
        meta_T2K = torch.cat([r.weights_TK.float(), r.expert_ids_TK.float()], 1)
        meta_S2K, _, _ = pith_ops.moe_permute(meta_T2K, dest_TR, R, rows=S)
        return x_SD, meta_S2K, slots_TR

    def receive(
        self, x_MD: Tensor, meta_M2K: Tensor, E: int, p: Plan
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """-> (x_ND rows grouped by local expert, group_ends_E, slots_MK, weights_MK) of the received
        rows and their metadata (E: experts in all)."""
        # Expand the received rows over this rank's experts; other experts' entries get slot -1, which
        # moe_unpermute skips (and gives a zero weight gradient).
        K, El = meta_M2K.shape[1] // 2, E // self.ranks
        weights_MK = meta_M2K[:, :K]
        local_MK = meta_M2K[:, K:].detach().long() - self.rank * El
        local_MK = torch.where((local_MK >= 0) & (local_MK < El), local_MK, -1)
        x_ND, slots_MK, group_ends_E = pith_ops.moe_permute(
            x_MD, local_MK, El, self.align, rows=p.recv_pairs + El * (self.align - 1)
        )
        return x_ND, group_ends_E, slots_MK, weights_MK

    def dispatch(self, r: Routing) -> tuple[Tensor, Tensor, Any]:
        c = self.counts(r)
        p = self.plan(c)
        x_SD, meta_S2K, slots_TR = self.send_layout(r, c.need_RT, p)
        x_MD = _AllToAll.apply(x_SD, p.recv_rows, p.send_rows, self.group)
        meta_M2K = _AllToAll.apply(meta_S2K, p.recv_rows, p.send_rows, self.group)
        x_ND, group_ends_E, slots_MK, weights_MK = self.receive(x_MD, meta_M2K, r.probs_TE.shape[-1], p)
        return x_ND, group_ends_E, _Handle(slots_MK, weights_MK, slots_TR, p.send_rows, p.recv_rows)

    def combine(self, y_ND: Tensor, handle: Any) -> tuple[Tensor, Tensor, Tensor]:
        h: _Handle = handle
        partial_MD = pith_ops.moe_unpermute(y_ND, h.slots_MK, h.weights_MK)
        rows_SD = _AllToAll.apply(partial_MD, h.send_rows, h.recv_rows, self.group)
        return rows_SD, h.slots_TR, torch.ones(h.slots_TR.shape, dtype=torch.float32, device=y_ND.device)
