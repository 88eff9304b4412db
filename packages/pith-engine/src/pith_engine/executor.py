"""Run a model through the five stages, optionally as separate autograd segments, optionally two at once.

Stages 2 and 4 go through an `ExpertComm` (`LocalExperts`, or the expert-parallel all-to-all). A
layer's stages are a generator of steps (`run_layer`) that yields right after issuing an all-to-all
and, resumed, waits for it (`interleave` runs two). `DIRECT` runs the pieces as one autograd graph;
a `Tape` records each as its own segment, whose backward is again steps (a schedule drives one
chunk's backward beside a forward)."""

import functools
from collections.abc import Generator
from typing import Any, Protocol

import pith_ops
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import FSDPModule
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from pith_engine.contract import DecoderLayer, MoEModel, Positions, Routing, model_positions

Steps = Generator[None, None, Any]  # stage pieces; each yield: an exchange is in flight


class Segments(Protocol):
    """How stage pieces run: a compute piece, or an all-to-all."""

    def __call__(self, fn, *args, owner: nn.Module | None = None): ...

    def exchange(self, tensors: list[Tensor], out_splits: list[int], in_splits: list[int], group) -> Steps:
        """Issue the all-to-all of `tensors`, yield, -> the received tensors."""


class ExpertComm(Protocol):
    """Stages 2 and 4 as generators of steps."""

    def dispatch(self, r: Routing, seg: Segments, fp8: bool = False) -> Steps:
        """Stage 2: -> (x_ND rows grouped by local expert, group_ends_E int32, handle for combine);
        fp8: the rows quantised once per token and moved in e4m3, x_ND a pith_ops.FP8Rows."""

    def combine(self, y_ND: Tensor, handle: Any, seg: Segments) -> Steps:
        """Stage 4: -> (rows, slots_TK, weights_TK) for stage 5's weighted sum."""


def drain(steps: Steps):
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def interleave(first: Steps, second: Steps, trace: list | None, tags: tuple) -> None:
    """Run two generators of steps, switching sides at each yield: every exchange of one overlaps the
    other's compute. trace: (tag, "issue") at each yield, (tag, "wait") at each resume."""
    sides, i = [(first, tags[0]), (second, tags[1])], 0
    issued = set()
    while sides:
        steps, tag = sides[i]
        if trace is not None and tag in issued:
            trace.append((tag, "wait"))
        try:
            next(steps)
        except StopIteration:
            sides.pop(i)
            i = 0
            continue
        if trace is not None:
            trace.append((tag, "issue"))
            issued.add(tag)
        i = (i + 1) % len(sides)


class Direct:
    def __call__(self, fn, *args, owner: nn.Module | None = None):
        return fn(*args)

    def exchange(self, tensors, out_splits, in_splits, group) -> Steps:
        yield from ()  # nothing left in flight
        return [_AllToAll.apply(t, out_splits, in_splits, group) for t in tensors]


DIRECT = Direct()


class LocalExperts:
    def __init__(self, align: int = 1):
        self.align = align

    def dispatch(self, r: Routing, seg: Segments = DIRECT, fp8: bool = False) -> Steps:
        yield from ()
        num_experts = r.probs_TE.shape[-1]
        rows = pith_ops.fp8_rows if fp8 else lambda x: x
        permute = lambda x, ids: pith_ops.moe_permute(rows(x), ids, num_experts, self.align)
        x_ND, slots_TK, group_ends_E = seg(permute, r.x_TD, r.expert_ids_TK)
        return x_ND, group_ends_E, (slots_TK, r.weights_TK)

    def combine(self, y_ND: Tensor, handle: Any, seg: Segments = DIRECT) -> Steps:
        yield from ()
        slots_TK, weights_TK = handle
        return y_ND, slots_TK, weights_TK


class Pending:
    """An all-to-all in flight (NCCL's stream); wait(): the current stream waits for it, the host does
    not. stand_in (see _stand_in): nothing is sent."""

    def __init__(
        self, x: Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup, stand_in=False
    ):
        if stand_in:
            self.out, self.work = x.new_zeros(()).expand(sum(out_splits), *x.shape[1:]), None
            return
        self.out = x.new_empty(sum(out_splits), *x.shape[1:])
        self.x = x.contiguous()  # kept alive until the exchange is done
        self.work = dist.all_to_all_single(self.out, self.x, out_splits, in_splits, group, async_op=True)

    def wait(self) -> Tensor:
        if self.work is not None:
            self.work.wait()
        return self.out

    def host(self, *more: Tensor) -> list[int]:
        """The output (and `more`) as host integers, waiting for the exchange only (a side stream copies
        it to pinned memory), not the compute queued since."""
        if not self.out.is_cuda:
            self.work.wait()
            return torch.cat([*more, self.out.flatten()]).tolist()
        side = _side_stream(self.out.device)
        with torch.cuda.stream(side):
            self.work.wait()
            values = torch.cat([*more, self.out.flatten()])
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        done.synchronize()
        return host.tolist()


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return Pending(x, out_splits, in_splits, group, _stand_in(x)).wait()

    @staticmethod
    def backward(ctx, grad: Tensor):
        out_splits, in_splits = ctx.splits
        return Pending(grad, in_splits, out_splits, ctx.group).wait(), None, None, None


def _stand_in(t: Tensor) -> bool:
    return t.ndim > 0 and not any(t.stride())  # zeros of strides 0 (pith_ops.FP8Rows' x): no values


class Tape:
    """The autograd segments of one forward (a pipeline chunk on one micro-batch). `tape(fn, *args)` runs
    fn on detached leaves of its differentiable args; `backward()` (steps) runs the segments newest
    first from the outputs' `seed`ed gradients, each leaf's grad going to the tensor it was detached
    from. Gradients are kept by id() beside their tensor, which the entry keeps alive: a reused address
    never finds a stale gradient. final: each FSDP `owner` reduces its gradients in its segment's
    backward (the step's last)."""

    def __init__(self, final: bool = False, trace: list | None = None, tag: str = ""):
        self.final, self.trace, self.tag = final, trace, tag
        # (leaves, the tensors they were detached from, outputs, owner or an exchange's splits, name)
        self.segments = []
        self.grads: dict[int, tuple[Tensor, Tensor]] = {}  # id(t) -> (t, its gradient)

    def _log(self, piece: str) -> None:
        if self.trace is not None:
            self.trace.append((self.tag, piece))

    def __call__(self, fn, *args, owner: nn.Module | None = None):
        flat, spec = tree_flatten(args)
        cut = [i for i, t in enumerate(flat) if isinstance(t, Tensor) and t.requires_grad]
        sources = [flat[i] for i in cut]
        for i in cut:
            flat[i] = flat[i].detach().requires_grad_()
        name = getattr(fn, "__name__", "stage")
        self._log(name)
        out = fn(*tree_unflatten(flat, spec))
        outputs = [t for t in tree_leaves(out) if isinstance(t, Tensor) and t.requires_grad]
        self.segments.append(([flat[i] for i in cut], sources, outputs, owner, name))
        return out

    def exchange(self, tensors, out_splits, in_splits, group) -> Steps:
        pending = [Pending(t.detach(), out_splits, in_splits, group, _stand_in(t)) for t in tensors]
        yield
        received = [p.wait().requires_grad_(t.requires_grad) for p, t in zip(pending, tensors)]
        sent = [t for t in tensors if t.requires_grad]
        got = [r for r, t in zip(received, tensors) if t.requires_grad]
        self.segments.append((sent, sent, got, (out_splits, in_splits, group), "exchange"))
        return received

    def seed(self, t: Tensor, grad: Tensor | None = None) -> None:
        """Give output t its gradient (ones: a loss term); none if t needs none (an aux loss off)."""
        if t.requires_grad:
            self._add(t, torch.ones_like(t) if grad is None else grad)

    def _add(self, t: Tensor, grad: Tensor | None) -> None:
        if grad is not None:
            held = self.grads.get(id(t))
            self.grads[id(t)] = (t, grad if held is None else held[1] + grad)

    def grad(self, t: Tensor) -> Tensor | None:
        held = self.grads.pop(id(t), None)
        assert held is None or held[0] is t
        return None if held is None else held[1]

    def backward(self) -> Steps:
        while self.segments:
            leaves, sources, outputs, owner, name = self.segments.pop()
            if isinstance(owner, tuple):  # an exchange: its gradients travel back the other way
                # Every rank issues the reverse exchange (a collective), with zeros where none came.
                out_splits, in_splits, group = owner
                grads = [self.grad(r) for r in outputs]
                grads = [torch.zeros_like(r) if g is None else g for g, r in zip(grads, outputs)]
                pending = [Pending(g, in_splits, out_splits, group) for g in grads]
                yield
                for src, p in zip(sources, pending):
                    self._add(src, p.wait())
                continue
            roots = [(t, g) for t in outputs if (g := self.grad(t)) is not None]
            if not roots:
                continue
            sync = self.final and isinstance(owner, FSDPModule)
            # recurse: nested units whose backward runs in this segment (a layer's fp32 router) reduce
            # with it; units with segments of their own (experts) are done by then.
            if sync:
                owner.set_requires_gradient_sync(True)
            self._log(name)
            torch.autograd.backward([t for t, _ in roots], [g for _, g in roots])
            if sync:
                owner.set_requires_gradient_sync(False)
            for leaf, src in zip(leaves, sources):
                self._add(src, leaf.grad)


def run_layer(
    layer: DecoderLayer,
    h_BSD: Tensor,
    pos: Positions,
    comm: ExpertComm,
    seg: Segments = DIRECT,
    module: nn.Module | None = None,
) -> Steps:
    """-> (h_BSD, routing or None); module: the layer's nn.Module when `layer` wraps its stage
    functions (step.Stages)."""
    s1 = seg(layer.stage1, h_BSD, pos, owner=module or layer)
    r = s1.routing
    if r is None:
        return s1.h_BSD, None
    fp8 = layer.experts is not None and layer.experts.fp8  # then their rows are sent in FP8
    x_ND, group_ends_E, handle = yield from comm.dispatch(r, seg, fp8)
    y_ND = seg(layer.stage3, x_ND, group_ends_E, owner=layer.experts if isinstance(seg, Tape) else None)
    y_ND, slots_TK, weights_TK = yield from comm.combine(y_ND, handle, seg)
    return seg(layer.stage5, s1.h_BSD, y_ND, slots_TK, weights_TK), r


def forward(model: MoEModel, input_ids_BS: Tensor, comm: ExpertComm, position_ids_BS: Tensor | None = None):
    pos = model_positions(model, input_ids_BS, position_ids_BS)
    h = model.prologue(input_ids_BS)
    routings = []
    for layer in model.layers.values():
        h, r = drain(run_layer(layer, h, pos, comm))
        if r is not None:
            routings.append(r)
    return model.epilogue(h), routings
