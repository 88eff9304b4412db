"""The layer and model contract the engine executes: a decoder layer cut at its expert-parallel
communication boundaries into the model's stages 1, 3 and 5 around the engine's dispatch (2) and
combine (4), so one micro-batch computes while another's all-to-all is in flight (the stages: pith-engine
README, "The contract"). Under EP stage 5 may get other slots/weights than the router's (one
pre-weighted row per destination rank); a slot < 0 contributes nothing. Models see process groups only
through `Positions.cp_group`.

Shape legend: B batch, S sequence (local to this rank under CP), T = B*S tokens, D model dim,
K router top-k, E experts, N rows grouped by expert (>= T*K when padded), V vocabulary, R rotary half-dim.
"""

from typing import NamedTuple, Protocol

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup


class Positions(NamedTuple):
    """Where the local tokens sit in their sequences: without CP in order, one step at a time
    (attention's CUDA fast paths use the index-based triangle); under CP zigzag halves of such a run."""

    position_ids_BS: Tensor  # global positions of the local tokens (zigzag order under CP)
    cos_BSR: Tensor  # fp32, model-specific scaling applied
    sin_BSR: Tensor
    cp_group: ProcessGroup | None
    doc_BS: Tensor | None = None  # document ids: attention stays within each


class Routing(NamedTuple):
    x_TD: Tensor  # expert input rows, one per token
    expert_ids_TK: Tensor  # int64 global expert ids
    weights_TK: Tensor  # fp32 combine weights, normalisation and scaling applied
    probs_TE: Tensor  # fp32 (load-balancing loss; has grad)
    logits_TE: Tensor  # (z-loss)


class Stage1Out(NamedTuple):
    h_BSD: Tensor  # after attention, plus shared experts (dense layer: its output)
    routing: Routing | None  # None: a dense layer, stages 2-5 skipped


class DecoderLayer(Protocol):
    # The routed experts: a module holding only their weights [E_held, ...], called by stage3 (so FSDP's
    # hooks run); None for a dense layer. Sliced under EP, sharded apart. Its FP8Switch `fp8`
    # flag: stage 2 sends it FP8 rows.
    experts: nn.Module | None
    # The router, a module stage1 calls (-> fp32 logits_TE), so FSDP can keep its weight fp32.
    router: nn.Module | None

    def stage1(self, h_BSD: Tensor, pos: Positions) -> Stage1Out: ...

    def stage3(self, x_ND: Tensor, group_ends_E: Tensor) -> Tensor:
        """Expert MLPs over rows grouped by local expert (group_ends: int32 cumulative row ends; rows
        past the last are padding). With `experts.fp8` set, x_ND is a pith_ops.FP8Rows (for
        pith_engine.layers.expert_gemm)."""

    def stage5(self, h_BSD: Tensor, y_ND: Tensor, slots_TK: Tensor, weights_TK: Tensor) -> Tensor: ...

    def reference_forward(self, h_BSD: Tensor, pos: Positions) -> Tensor:
        """The whole layer in plain PyTorch, no staging or fused kernels: the specification."""


class MoEModel(Protocol):
    layers: nn.ModuleDict  # DecoderLayers keyed by str(global layer index), in order (maybe a subset)
    lm_head: nn.Linear  # weight [V, D]; the loss fuses it (pith_ops.linear_cross_entropy)

    def prologue(self, input_ids_BS: Tensor) -> Tensor: ...

    def positions(self, position_ids_BS: Tensor, cp_group: ProcessGroup | None = None) -> Positions: ...

    def epilogue(self, h_BSD: Tensor) -> Tensor: ...  # final norm

    def reference_forward(self, input_ids_BS: Tensor) -> Tensor:
        """Logits [B, S, V] in plain PyTorch (positions 0..S-1, no parallelism)."""


def default_position_ids(input_ids_BS: Tensor) -> Tensor:
    B, S = input_ids_BS.shape
    return torch.arange(S, device=input_ids_BS.device).expand(B, S)


def model_positions(model: MoEModel, input_ids_BS: Tensor, position_ids_BS: Tensor | None = None):
    """Positions of 0..S-1, or of position ids restarting at 0 at each document (their doc_BS too)."""
    if position_ids_BS is None:
        return model.positions(default_position_ids(input_ids_BS))
    return model.positions(position_ids_BS)._replace(doc_BS=(position_ids_BS == 0).cumsum(1))
