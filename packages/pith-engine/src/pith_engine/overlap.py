"""The overlapped pair: one micro-batch's forward interleaved with another's backward, stage by stage,
so that each all-to-all of one is in flight while the other computes (DualPipe's overlapped
forward+backward; with pp=1, Megatron-LM's EP all-to-all overlap of micro-batch i+1's forward with
micro-batch i's backward).

A side is a list of `Step`s: compute steps run at once; communication steps are issued, and waited
for just before the side's next step. `interleave` is the order (a pure function, tested);
`run_pair` executes it; `run_overlapped` runs a pp=1 step's micro-batches so. `MicroBatch` cuts
one micro-batch (or a chunk of its layers) into such steps: every stage an autograd segment of its
own (`Segment`: detached inputs, kept outputs, backward when the schedule says), stages 2 and 4
under expert parallelism as communication steps whose exchanges, forward and backward, are issued
asynchronously (`expert_parallel.Pending`).

The interleave of one MoE layer's forward (F, micro-batch i+1) with one layer's backward (B,
micro-batch i), where F2's issue holds the layer's host sync (the exchange counts, issued at the end
of F1):

    F1  F2.issue  B5  B4.issue  F2.wait F3  F4.issue  B4.wait B3  B2.issue  F4.wait F5  B2.wait B1

Shape legend: B batch, S sequence, D model dim, T tokens, K top-k, E experts (all), S_ rows sent,
M rows received, N grouped rows.
"""

from collections.abc import Callable, Sequence
from enum import Enum
from typing import NamedTuple

import pith_ops
import torch
from torch import Tensor

from pith_engine.contract import MoEModel, Positions, Routing
from pith_engine.expert_parallel import ExpertParallel, Pending
from pith_engine.layers import WeightGradQueue
from pith_engine.parallel import held_layers


class Phase(Enum):
    RUN = "run"  # a compute step
    ISSUE = "issue"  # start a communication step's exchange
    WAIT = "wait"  # finish it


class Step(NamedTuple):
    name: str  # for traces, side first: "F3 L0" stage 3 of layer 0 forward, "BL" the loss's backward
    run: Callable[[], None] | None  # a compute step; None for a communication step
    issue: Callable[[], None] | None = None  # a communication step: start its exchange
    wait: Callable[[], None] | None = None  # wait for it and finish the step


def interleave(first: Sequence[bool], second: Sequence[bool]) -> list[tuple[int, int, Phase]]:
    """The order of an overlapped pair of step sequences (True marks a communication step) ->
    [(side 0 or 1, step index, phase)]. A side waits for its exchange in flight, runs its compute
    steps up to its next communication step, issues that and hands over to the other side (it
    stays when the other has nothing left). So each exchange of one side is in flight while the
    other runs its next compute steps, as long as the other has some."""
    seqs, pos, pending = (first, second), [0, 0], [None, None]
    left = lambda s: pos[s] < len(seqs[s]) or pending[s] is not None
    order, side = [], 0
    while left(0) or left(1):
        if pending[side] is not None:
            order.append((side, pending[side], Phase.WAIT))
            pending[side] = None
        while pos[side] < len(seqs[side]) and not seqs[side][pos[side]]:
            order.append((side, pos[side], Phase.RUN))
            pos[side] += 1
        if pos[side] < len(seqs[side]):
            order.append((side, pos[side], Phase.ISSUE))
            pending[side] = pos[side]
            pos[side] += 1
        if left(1 - side):
            side = 1 - side
    return order


def run_pair(first: Sequence[Step], second: Sequence[Step], trace: list[str] | None = None) -> None:
    """Run two step sequences interleaved (`second` may be empty: one side alone, each exchange
    waited for right after it is issued); `trace` collects "<name> <phase>" in the order run."""
    sides = (first, second)
    for side, i, phase in interleave(*([s.run is None for s in steps] for steps in sides)):
        step = sides[side][i]
        (step.run if phase is Phase.RUN else step.issue if phase is Phase.ISSUE else step.wait)()
        if trace is not None:
            trace.append(f"{step.name} {phase.value}")


def run_overlapped(micro_batches: Sequence["MicroBatch"], queue: WeightGradQueue | None = None) -> None:
    """A step's micro-batches without pipeline parallelism: F(0), then F(i+1) overlapped with B(i),
    then B(last). With a queue each backward's weight gradients are deferred and run right after
    the pair (pp=1 has no bubble to move them into; the queue is how the same code serves DualPipeV)."""
    fwd = [mb.forward_steps for mb in micro_batches] + [lambda: []]
    bwd = [lambda: []] + [mb.backward_steps for mb in micro_batches]
    for f, b in zip(fwd, bwd):
        if queue is None:
            run_pair(f(), b())
            continue
        with queue.deferring():
            run_pair(f(), b())
        queue.run_next()


class Segment:
    """fn over detached copies of its tensor inputs (the floating-point ones leaves needing grad), run
    as an autograd graph of its own; backward(*output grads) -> the inputs' grads (None where an
    input is no float tensor or got none). Parameters inside accumulate .grad as usual."""

    def __init__(self, fn: Callable, *inputs):
        leaf = lambda t: t.detach().requires_grad_() if isinstance(t, Tensor) and t.is_floating_point() else t
        self.inputs = [leaf(t) for t in inputs]
        with torch.enable_grad():
            out = fn(*self.inputs)
        self.outputs = tuple(out) if isinstance(out, tuple) else (out,)

    def backward(self, *grads: Tensor | None) -> list[Tensor | None]:
        pairs = [(o, g) for o, g in zip(self.outputs, grads, strict=True) if g is not None]
        pairs = [(o, g) for o, g in pairs if o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return [t.grad if isinstance(t, Tensor) and t.is_floating_point() else None for t in self.inputs]


class MicroBatch:
    """One micro-batch through the layers `chunk` (indices into model.layers; all by default) as
    steps: `forward_steps()` then, after they ran, `backward_steps()`. The chunk holding layer 0 runs
    the prologue on input_ids; otherwise set `h` (the received activation) before the forward. The
    chunk holding the last layer ends in loss_fn(epilogue output), whose backward starts from 1;
    otherwise set `dh` (the received gradient) before the backward. After the forward `h` is the
    chunk's output; after the backward `dh` the gradient of its input (pipeline sends read them).
    aux_fn(routing) -> scalar, if given, is each MoE layer's auxiliary loss term, computed in that
    layer's stage-1 segment and back-propagated from there (d term = 1); `aux` sums them.
    comm is the ExpertParallel of the EP group."""

    def __init__(
        self,
        model: MoEModel,
        comm: ExpertParallel,
        input_ids_BS: Tensor,
        pos: Positions,
        loss_fn: Callable[[Tensor], Tensor] | None,
        aux_fn: Callable[[Routing], Tensor] | None = None,
        chunk: range | None = None,
    ):
        self.model, self.comm, self.pos, self.loss_fn, self.aux_fn = model, comm, pos, loss_fn, aux_fn
        self.chunk = chunk or range(len(model.layers))
        self.aux = torch.zeros(())
        self.input_ids = input_ids_BS
        self.h: Tensor | None = None  # the residual stream between forward steps
        self.dh: Tensor | None = None  # its gradient between backward steps
        self.loss: Tensor | None = None

    def forward_steps(self) -> list[Step]:
        def prologue():
            self.prologue = Segment(self.model.prologue, self.input_ids)
            self.h = self.prologue.outputs[0]

        def loss():
            self.head = Segment(lambda h: self.loss_fn(self.model.epilogue(h)), self.h)
            self.loss = self.head.outputs[0].detach()

        steps = [Step("FP", prologue)] if self.chunk.start == 0 else []
        self.layers = [_LayerRun(self, held_layers(self.model)[i], i) for i in self.chunk]
        for run in self.layers:
            steps += run.forward_steps()
        return steps + ([Step("FL", loss)] if self.chunk.stop == len(self.model.layers) else [])

    def backward_steps(self) -> list[Step]:
        def loss():
            (self.dh,) = self.head.backward(torch.ones_like(self.head.outputs[0]))

        steps = [Step("BL", loss)] if self.chunk.stop == len(self.model.layers) else []
        for run in reversed(self.layers):
            steps += run.backward_steps()
        first = self.chunk.start == 0
        return steps + ([Step("BP", lambda: self.prologue.backward(self.dh))] if first else [])


class _LayerRun:
    """One layer of one micro-batch, stage by stage (the names F1..F5 / B5..B1 in traces)."""

    def __init__(self, mb: MicroBatch, layer, index: int):
        self.mb, self.layer, self.tag = mb, layer, f"L{index}"

    def forward_steps(self) -> list[Step]:
        mb, comm, t = self.mb, self.mb.comm, self.tag

        def f1():
            def stage1(h):
                s1 = self.layer.stage1(h, mb.pos)
                r = s1.routing
                if r is None:
                    return (s1.h_BSD,)
                return (s1.h_BSD, *r, mb.aux_fn(r) if mb.aux_fn else torch.zeros((), device=h.device))

            self.s1 = Segment(stage1, mb.h)
            self.routing = None if len(self.s1.outputs) == 1 else Routing(*self.s1.outputs[1:-1])
            if self.routing is None:
                mb.h = self.s1.outputs[0]
            else:  # issued early: its wait in F2.issue is the layer's host sync
                mb.aux = mb.aux + self.s1.outputs[-1].detach()
                self.counts = comm.counts(self.routing)

        def f2_issue():
            self.plan = p = comm.plan(self.counts)
            r = self.routing
            send = lambda x, w: comm.send_layout(r._replace(x_TD=x, weights_TK=w), self.counts.need_RT, p)
            self.s2a = Segment(send, r.x_TD, r.weights_TK)
            x_SD, meta_S2K, self.slots_TR = self.s2a.outputs
            self.sent = [Pending(a.detach(), p.recv_rows, p.send_rows, comm.group) for a in (x_SD, meta_S2K)]

        def f2_wait():
            E = self.routing.probs_TE.shape[-1]
            x_MD, meta_M2K = (pending.wait() for pending in self.sent)
            self.s2b = Segment(lambda x, m: comm.receive(x, m, E, self.plan), x_MD, meta_M2K)

        def f3():
            x_ND, ends_E, _, _ = self.s2b.outputs
            self.s3 = Segment(self.layer.stage3, x_ND, ends_E)

        def f4_issue():
            _, _, slots_MK, weights_MK = self.s2b.outputs
            self.s4 = Segment(pith_ops.moe_unpermute, self.s3.outputs[0], slots_MK, weights_MK)
            p = self.plan
            self.back = Pending(self.s4.outputs[0].detach(), p.send_rows, p.recv_rows, comm.group)

        def f5():
            ones = torch.ones(self.slots_TR.shape, dtype=torch.float32, device=self.slots_TR.device)
            stage5 = lambda h, rows: self.layer.stage5(h, rows, self.slots_TR, ones)
            self.s5 = Segment(stage5, self.s1.outputs[0], self.rows_SD)
            mb.h = self.s5.outputs[0]

        def f4_wait():
            self.rows_SD = self.back.wait()

        if self.layer.experts is None:
            return [Step(f"F1 {t}", f1)]
        return [
            Step(f"F1 {t}", f1),
            Step(f"F2 {t}", None, f2_issue, f2_wait),
            Step(f"F3 {t}", f3),
            Step(f"F4 {t}", None, f4_issue, f4_wait),
            Step(f"F5 {t}", f5),
        ]

    def backward_steps(self) -> list[Step]:
        mb, comm, t = self.mb, self.mb.comm, self.tag

        def b1():
            if self.routing is None:
                mb.dh = self.s1.backward(mb.dh)[0]
            else:
                d_x_TD, d_weights_TK = self.d_routing
                d_aux = torch.ones_like(self.s1.outputs[-1]) if mb.aux_fn else None
                mb.dh = self.s1.backward(self.d_h1, d_x_TD, None, d_weights_TK, None, None, d_aux)[0]
            del self.s1  # each segment is dropped after its backward: its activations go with it

        def b5():
            self.d_h1, self.d_rows_SD = self.s5.backward(mb.dh)
            del self.s5

        def b4_issue():
            p = self.plan
            self.d_pending = Pending(self.d_rows_SD, p.recv_rows, p.send_rows, comm.group)

        def b4_wait():
            self.d_y, _, self.d_weights_MK = self.s4.backward(self.d_pending.wait())
            del self.s4, self.d_pending, self.d_rows_SD

        def b3():
            self.d_x_ND = self.s3.backward(self.d_y)[0]
            del self.s3, self.d_y

        def b2_issue():
            p = self.plan
            d_x_MD, d_meta_M2K = self.s2b.backward(self.d_x_ND, None, None, self.d_weights_MK)
            del self.s2b, self.d_x_ND, self.d_weights_MK
            self.d_sent = [Pending(g, p.send_rows, p.recv_rows, comm.group) for g in (d_x_MD, d_meta_M2K)]

        def b2_wait():
            d_x_SD, d_meta_S2K = (pending.wait() for pending in self.d_sent)
            self.d_routing = self.s2a.backward(d_x_SD, d_meta_S2K, None)
            del self.s2a, self.d_sent

        if self.layer.experts is None:
            return [Step(f"B1 {t}", b1)]
        return [
            Step(f"B5 {t}", b5),
            Step(f"B4 {t}", None, b4_issue, b4_wait),
            Step(f"B3 {t}", b3),
            Step(f"B2 {t}", None, b2_issue, b2_wait),
            Step(f"B1 {t}", b1),
        ]
