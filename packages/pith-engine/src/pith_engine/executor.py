"""Run a model through the five stages, optionally as separate autograd segments.

Stages 2 and 4 go through an `ExpertComm`: `LocalExperts` keeps every expert on this process
(permute, identity); the expert-parallel engine supplies one that exchanges rows by all-to-all.
The same stage functions run in both cases; there is no second code path.

`run_layer(..., tape)` runs each stage as its own autograd segment on a `Tape` (the training step,
pith_engine.step: a pipeline schedule drives one chunk's backward segment by segment while it runs
another's forward); without a tape the stages form one autograd graph (`forward`, evaluation, tests).
"""

from typing import Any, Protocol

import pith_ops
import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import FSDPModule
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

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


class Tape:
    """The autograd segments of one forward (a pipeline chunk on one micro-batch), oldest first.

    `tape(fn, *args)` runs fn with every tensor in args that requires grad replaced by a detached leaf
    that requires grad, and keeps fn's outputs. `seed(t, grad)` gives an output its gradient (ones for
    a loss term). `backward()` then runs the segments newest first, each one
    torch.autograd.backward(its seeded outputs, their grads): parameters accumulate their .grad as
    usual, and each input leaf's grad becomes the grad of the tensor it was detached from, for the
    segment that produced it. What is left is keyed by id() of the tensors the tape did not produce
    (the chunk's input).

    final: this is the step's last backward of the modules its segments name as `owner`: each such
    FSDP module reduces its gradients in that segment's backward and in no other (they accumulate
    unreduced until then, pith_engine.step)."""

    def __init__(self, final: bool = False):
        self.final = final
        self.segments = []  # (input leaves, the tensors they were detached from, outputs, owner)
        self.grads: dict[int, Tensor] = {}

    def __call__(self, fn, *args, owner: nn.Module | None = None):
        flat, spec = tree_flatten(args)
        cut = [i for i, t in enumerate(flat) if isinstance(t, Tensor) and t.requires_grad]
        sources = [flat[i] for i in cut]
        for i in cut:
            flat[i] = flat[i].detach().requires_grad_()
        out = fn(*tree_unflatten(flat, spec))
        outputs = [t for t in tree_leaves(out) if isinstance(t, Tensor) and t.requires_grad]
        self.segments.append(([flat[i] for i in cut], sources, outputs, owner))
        return out

    def seed(self, t: Tensor, grad: Tensor | None = None) -> None:
        self.grads[id(t)] = torch.ones_like(t) if grad is None else grad

    def backward(self) -> dict[int, Tensor]:
        while self.segments:
            leaves, sources, outputs, owner = self.segments.pop()
            roots = [(t, self.grads.pop(id(t))) for t in outputs if id(t) in self.grads]
            if not roots:
                continue
            sync = self.final and isinstance(owner, FSDPModule)
            # recurse: units nested in the owner whose backward runs in its segment (a layer's fp32
            # router unit) reduce with it; units with segments of their own (experts) are done by then.
            if sync:
                owner.set_requires_gradient_sync(True)
            torch.autograd.backward([t for t, _ in roots], [g for _, g in roots])
            if sync:
                owner.set_requires_gradient_sync(False)
            for leaf, src in zip(leaves, sources):
                if leaf.grad is not None:
                    key = id(src)
                    self.grads[key] = leaf.grad if key not in self.grads else self.grads[key] + leaf.grad
        return self.grads


def run_layer(
    layer: DecoderLayer,
    h_BSD: Tensor,
    pos: Positions,
    comm: ExpertComm,
    tape: Tape | None = None,
    module: nn.Module | None = None,
) -> tuple[Tensor, Routing | None]:
    """The five stages of one layer; with a tape, each its own segment. module: the layer's nn.Module
    (its FSDP unit) when `layer` wraps its stage functions (pith_engine.step.Stages)."""
    seg = tape or (lambda fn, *args, owner=None: fn(*args))
    s1 = seg(layer.stage1, h_BSD, pos, owner=module or layer)
    r = s1.routing
    if r is None:
        return s1.h_BSD, None
    x_ND, group_ends_E, handle = seg(comm.dispatch, r)
    y_ND = seg(layer.stage3, x_ND, group_ends_E, owner=layer.experts if tape else None)
    y_ND, slots_TK, weights_TK = seg(comm.combine, y_ND, handle)
    return seg(layer.stage5, s1.h_BSD, y_ND, slots_TK, weights_TK), r


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
