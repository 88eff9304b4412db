"""Expert parallelism: stages 2 and 4 as all-to-all exchanges over the EP group, deduplicated (the
design, its one host sync per MoE layer and its collectives: pith-engine README, "Parallelism"). EP
rank r of R holds the global experts [r*El, (r+1)*El). With FP8 rows a layer makes 5 all-to-alls
forward, not 4, of half bf16's bytes.

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
from pith_engine.executor import DIRECT, Pending, Segments, Steps


class Plan(NamedTuple):
    """Split sizes of one MoE layer's exchanges, on the host (ExpertParallel.plan)."""

    send_rows: list[int]  # to each EP rank (dispatch; received back in combine)
    recv_rows: list[int]
    recv_pairs: int  # (received row, local expert) pairs: the grouped rows before padding


class Counts(NamedTuple):
    """Dispatch's first exchange in flight: per destination (tokens, pairs), sent and received."""

    need_RT: Tensor  # bool: token t goes to rank r
    send_counts_R2: Tensor
    recv: Pending


class _Handle(NamedTuple):
    slots_MK: Tensor  # receiver: grouped row of each (received row, k), -1: not a local expert
    weights_MK: Tensor  # receiver, with grad
    slots_TR: Tensor  # source: returned row of (token, rank), -1: nothing went to that rank
    send_rows: list[int]
    recv_rows: list[int]


class ExpertParallel:
    """Stages 2 and 4 across an EP group: dispatch = counts (issued), plan (the host sync),
    send_layout, rows and metadata (issued), receive; combine = partial rows back (issued)."""

    def __init__(self, group: ProcessGroup, align: int = 1):
        self.group, self.ranks, self.align = group, dist.get_world_size(group), align
        self.rank = dist.get_rank(group)

    def counts(self, r: Routing) -> Counts:
        E, R, dev = r.probs_TE.shape[-1], self.ranks, r.x_TD.device
        if E % R:
            raise ValueError(f"expert parallelism: {E} experts do not divide over ep={R} ranks")
        dest_TK = r.expert_ids_TK // (E // R)
        # A one-hot [R, T, K] of bools, not an index_put of True, whose scalar is a host copy.
        hit_RTK = dest_TK[None] == torch.arange(R, device=dev)[:, None, None]
        need_RT = hit_RTK.any(2)
        send_counts_R2 = torch.stack([need_RT.sum(1), hit_RTK.sum((1, 2))], 1)
        return Counts(need_RT, send_counts_R2, Pending(send_counts_R2, [1] * R, [1] * R, self.group))

    def plan(self, c: Counts) -> Plan:
        """Wait for the counts: the layer's one host sync, for the exchange alone (Pending.host)."""
        R = self.ranks
        counts = c.recv.host(c.send_counts_R2[:, 0])
        return Plan(counts[:R], counts[R::2], sum(counts[R + 1 :: 2]))

    def send_layout(self, r: Routing, need_RT: Tensor, p: Plan, fp8: bool = False) -> tuple:
        """-> (rows x_SD, metadata meta_S2K, slots_TR) in the all-to-all's send layout; fp8: the rows
        quantised per token, x_SD a pith_ops.FP8Rows."""
        # Source: "expert" r of token t is destination rank r (-1: not sent there), so moe_permute lays
        # the rows out by destination, token order within: the send layout. slots_TR is where each
        # (token, rank) row went, and so where it comes back in combine.
        R, S = self.ranks, sum(p.send_rows)
        dest_TR = torch.where(need_RT.T, torch.arange(R, device=need_RT.device), -1)
        x_SD, slots_TR, _ = pith_ops.moe_permute(
            pith_ops.fp8_rows(r.x_TD) if fp8 else r.x_TD, dest_TR, R, rows=S
        )
        # Weights and global ids share one fp32 permute and exchange (ids < 2^24 are exact in fp32);
        # its gradient carries the weights' back.
        meta_T2K = torch.cat([r.weights_TK.float(), r.expert_ids_TK.float()], 1)
        meta_S2K, _, _ = pith_ops.moe_permute(meta_T2K, dest_TR, R, rows=S)
        return x_SD, meta_S2K, slots_TR

    def receive(self, x_MD, meta_M2K: Tensor, E: int, p: Plan) -> tuple:
        """-> (x_ND rows grouped by local expert, group_ends_E, slots_MK, weights_MK)."""
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

    def dispatch(self, r: Routing, seg: Segments = DIRECT, fp8: bool = False) -> Steps:
        # The first yield lets the other side of an overlapped pair compute before the host sync.
        c = self.counts(r)
        yield
        p = self.plan(c)
        x_SD, meta_S2K, slots_TR = seg(self.send_layout, r, c.need_RT, p, fp8)
        sent = [x_SD.x, x_SD.q.view(torch.uint8), x_SD.scale] if fp8 else [x_SD]
        *x_MD, meta_M2K = yield from seg.exchange([*sent, meta_S2K], p.recv_rows, p.send_rows, self.group)
        x_MD = pith_ops.FP8Rows(x_MD[0], x_MD[1].view(x_SD.q.dtype), x_MD[2]) if fp8 else x_MD[0]
        x_ND, group_ends_E, slots_MK, weights_MK = seg(self.receive, x_MD, meta_M2K, r.probs_TE.shape[-1], p)
        return x_ND, group_ends_E, _Handle(slots_MK, weights_MK, slots_TR, p.send_rows, p.recv_rows)

    def combine(self, y_ND: Tensor, handle: Any, seg: Segments = DIRECT) -> Steps:
        h: _Handle = handle
        partial_MD = seg(pith_ops.moe_unpermute, y_ND, h.slots_MK, h.weights_MK)
        (rows_SD,) = yield from seg.exchange([partial_MD], h.send_rows, h.recv_rows, self.group)
        return rows_SD, h.slots_TR, torch.ones(h.slots_TR.shape, dtype=torch.float32, device=y_ND.device)
