"""Run a model through the five stages on one process (no pipeline).

Stages 2 and 4 go through an `ExpertComm`: `LocalExperts` keeps every expert on this process
(permute, identity); the expert-parallel engine supplies one that exchanges rows by all-to-all.
The same stage functions run in both cases; there is no second code path.
"""

from typing import Any, Protocol

import pith_ops
from torch import Tensor
from torch.distributed import ProcessGroup

from pith_engine.contract import DecoderLayer, MoEModel, Positions, Routing, default_position_ids


class ExpertComm(Protocol):
    def dispatch(self, r: Routing) -> tuple[Tensor, Tensor, Any]:
        """Stage 2: -> (x_ND rows grouped by local expert, group_ends_E int32, handle for combine)."""
        ...

    def combine(self, y_ND: Tensor, handle: Any) -> tuple[Tensor, Tensor, Tensor]:
        """Stage 4: -> (rows, slots_TK, weights_TK) for stage 5's weighted sum."""
        ...


class LocalExperts:
    """Stages 2 and 4 when this process holds every expert."""

    def __init__(self, align: int = 1):
        self.align = align  # per-expert row padding the grouped GEMM prefers

    def dispatch(self, r: Routing) -> tuple[Tensor, Tensor, Any]:
        num_experts = r.probs_TE.shape[-1]
        x_ND, slots_TK, group_ends_E = pith_ops.moe_permute(r.x_TD, r.expert_ids_TK, num_experts, self.align)
        return x_ND, group_ends_E, (slots_TK, r.weights_TK)

    def combine(self, y_ND: Tensor, handle: Any) -> tuple[Tensor, Tensor, Tensor]:
        slots_TK, weights_TK = handle
        return y_ND, slots_TK, weights_TK


def run_layer(
    layer: DecoderLayer, h_BSD: Tensor, pos: Positions, comm: ExpertComm
) -> tuple[Tensor, Routing | None]:
    s1 = layer.stage1(h_BSD, pos)
    r = s1.routing
    if r is None:
        return s1.h_BSD, None
    x_ND, group_ends_E, handle = comm.dispatch(r)
    y_ND = layer.stage3(x_ND, group_ends_E)
    y_ND, slots_TK, weights_TK = comm.combine(y_ND, handle)
    return layer.stage5(s1.h_BSD, y_ND, slots_TK, weights_TK), r


def forward(
    model: MoEModel,
    input_ids_BS: Tensor,
    comm: ExpertComm,
    position_ids_BS: Tensor | None = None,
    cp_group: ProcessGroup | None = None,
) -> tuple[Tensor, list[Routing]]:
    """Prologue, every layer's stages, epilogue -> (final normed h_BSD, the MoE layers' routings)."""
    if position_ids_BS is None:
        position_ids_BS = default_position_ids(input_ids_BS)
    pos = model.positions(position_ids_BS, cp_group)
    h = model.prologue(input_ids_BS)
    routings = []
    for layer in model.layers.values():
        h, r = run_layer(layer, h, pos, comm)
        if r is not None:
            routings.append(r)
    return model.epilogue(h), routings
