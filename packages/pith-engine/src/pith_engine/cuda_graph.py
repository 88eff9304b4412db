"""The training step's forward and backward work as one CUDA graph (train.cuda_graph)."""

from collections.abc import Callable

import pith_ops
import torch
from torch import Tensor, nn


class StepGraph:
    """train_step's schedule work (`work`) as one CUDA graph: eager at the first call, captured at the
    second, replayed after, so a step whose launches outrun its kernels (FP8's) runs at the GPU's pace.
    A replay has no host sync (tested) and the same addresses every step. The eager call runs on the
    capture stream, so compilation and autotuning happen outside the capture. One CUDA process, one
    shape of micro-batches, one Aux, and weights written only by the optimizer: ValueError else."""

    def __init__(self, work: Callable):
        self.work = work  # step._schedule_work
        self.graph: torch.cuda.CUDAGraph | None = None
        self.stream: torch.cuda.Stream | None = None
        self.inputs: list[Tensor] = []
        self.out = None
        self.grads: list[tuple[nn.Parameter, Tensor | None, Tensor | None]] = []
        self.aux = None  # the step.Aux captured
        self.read: list[tuple[nn.Parameter, torch.dtype, tuple[Tensor, ...]]] = []  # kept copies it reads

    def __call__(self, stages, micro: list, aux):
        flat = [t for m in micro for t in m if t is not None]
        first = self.stream is None  # the eager step, on copies of the inputs the graph will read
        if first:
            self.stream = torch.cuda.Stream(stages.mesh.device)
            self.inputs = [t.contiguous().clone() for t in flat]
        shapes = [(t.shape, t.dtype) for t in flat]
        if shapes != [(t.shape, t.dtype) for t in self.inputs]:
            raise ValueError(
                f"a CUDA graph step takes one shape of micro-batches: captured {len(self.inputs)} tensors"
                f" {[tuple(t.shape) for t in self.inputs[:2]]}..., got {[tuple(t) for t, _ in shapes[:2]]}"
            )
        if self.graph is not None:
            self._check(aux)
        for static, t in zip(self.inputs, flat):
            static.copy_(t)
        static = iter(self.inputs)
        static_micro = [tuple(None if t is None else next(static) for t in m) for m in micro]
        if first:  # on copies: what it caches by input tensor (block masks) the capture must build
            copies = [tuple(t if t is None else t.clone() for t in m) for m in static_micro]
            return self._on_stream(self.work, stages, copies, aux)
        if self.graph is None:
            self._on_stream(self._capture, stages, static_micro, aux)
        self.graph.replay()
        for p, g, held in self.grads:
            p.grad = g
            if held is not None:
                p._pith_grad = held
        return self.out

    def _on_stream(self, fn, *args):
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            out = fn(*args)
        torch.cuda.current_stream().wait_stream(self.stream)
        return out

    @staticmethod
    def _kept(p: Tensor, kind: torch.dtype) -> tuple[Tensor, ...]:
        copy = pith_ops.kept_copy(p, kind)
        return () if copy is None else (copy,) if isinstance(copy, Tensor) else tuple(copy[:4])

    def _check(self, aux) -> None:
        if aux != self.aux:
            raise ValueError(f"a CUDA graph step keeps the loss terms it captured ({self.aux}), got {aux}")
        for p, kind, copies in self.read:
            now = self._kept(p, kind)
            if len(now) != len(copies) or any(a is not b for a, b in zip(now, copies)):
                raise ValueError(
                    f"a weight of shape {tuple(p.shape)} was written outside the optimizer after the CUDA"
                    " graph was captured (its kept copies, which the graph reads, are gone): build the"
                    " Stages anew after loading weights"
                )

    def _capture(self, stages, micro: list, aux) -> None:
        params = list(stages.model.parameters())
        if any(p.grad is not None or "_pith_grad" in p.__dict__ for p in params):
            raise ValueError("StepGraph: the capture starts from no gradients (the optimizer's zero_grad)")
        self.aux = aux
        kinds = (torch.bfloat16, torch.float8_e4m3fn)
        self.read = [(p, k, kept) for p in params for k in kinds if (kept := self._kept(p, k))]
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the eager step's cached blocks: the graph allocates from its own pool
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=self.stream):
            self.out = self.work(stages, micro, aux)
        self.grads = [(p, p.grad, p.__dict__.get("_pith_grad")) for p in params]
