"""The training step's forward and backward work as one CUDA graph (train.cuda_graph)."""

from collections.abc import Callable

import pith_ops
import torch
from torch import Tensor, nn


class StepGraph:
    """The schedule's forward and backward work of train_step (`work`) as one CUDA graph: run eagerly
    at the first call, captured at the second and replayed from then on, so the host launches one graph
    instead of the step's thousands of kernels (and their Python) and a step whose launches
    outrun its kernels (FP8's) runs at the GPU's pace. The gradient norm, the optimizer and the
    expert-bias update stay eager: their few hundred launches queue while the graph runs.

    What makes a replay the step: the step has no host sync (tested), so no value of one step steers
    its Python, and its kernels read and write the same addresses every step: the micro-batches are
    copied into the graph's own input tensors, the gradients land in the tensors the capture made
    (set back on the parameters after each replay, as the optimizer's zero_grad drops them), and the
    weights' kept copies (pith_ops.cast, FP8Switch.fp8_weight) are rewritten in place by the
    optimizer. The eager first call runs on the capture stream, so lazy library state, compilation
    and autotuning happen outside the capture, and the capture sees the optimizer's state in memory
    (peak memory measured after it is the step's). One process (an expert, context or data exchange
    needs host-side sizes from its peers; FSDP runs Python hooks inside the step), CUDA, one shape of
    micro-batches and one Aux (the graph keeps the captured ones); a weight whose kept copies the
    graph reads must keep them (a weight written outside the optimizer, e.g. a checkpoint loaded into
    the model, drops them): each is a ValueError before the replay. The graph's memory pool holds
    the step's activations between steps, so evaluation allocates beside it."""

    def __init__(self, work: Callable):
        self.work = work  # (stages, micro, aux) -> the step's work's outputs: step._schedule_work
        self.graph: torch.cuda.CUDAGraph | None = None
        self.stream: torch.cuda.Stream | None = None
        self.inputs: list[Tensor] = []
        self.out = None
        self.grads: list[tuple[nn.Parameter, Tensor | None, Tensor | None]] = []
        self.aux = None  # the step.Aux captured
        self.read: list[tuple[nn.Parameter, torch.dtype, tuple[Tensor, ...]]] = []  # kept copies it reads

    def __call__(self, stages, micro: list, aux):
        flat = [t for m in micro for t in m if t is not None]
        first = self.stream is None  # the eager step, on the inputs (their strides) the graph will read
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
        if first:
            return self._on_stream(self.work, stages, static_micro, aux)
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
