"""Weight-gradient delay: a queue of weight-gradient work that backward passes leave for the
schedule's W actions, and the autograd Function that defers it (defer_wgrad)."""

from collections import deque
from collections.abc import Callable
from contextlib import contextmanager

import pith_ops
import torch
from torch import Tensor, nn

from pith_engine.fp8 import FP8Switch


class WeightGradQueue:
    """A backward inside `with queue.deferring():` computes input gradients at once and leaves its
    weight work here as one group; `run_next()` runs the oldest group into .grad, bit for bit the plain
    backward's (tested)."""

    def __init__(self):
        self._groups: deque[list] = deque()
        self._open: list | None = None

    @contextmanager
    def deferring(self, enabled: bool = True):
        """One group (one W's work); enabled=False: nothing deferred, an empty group for its W."""
        assert self._open is None, "WeightGradQueue.deferring() does not nest"
        group = []
        self._open = group if enabled else None
        try:
            yield
        finally:
            self._groups.append(group)
            self._open = None

    def defer(self, weights: tuple[Tensor, ...], wgrad: Callable[[], tuple[Tensor, ...]]) -> bool:
        if self._open is None:
            return False
        self._open.append((weights, wgrad))
        return True

    def run_next(self) -> None:
        tensors, grads = [], []
        for weights, wgrad in self._groups.popleft():
            for w, g in zip(weights, wgrad()):
                g = pith_ops.weight_grad(w, g)  # None: held by w (a kept gradient, pith_ops.cast)
                if g is not None:
                    tensors.append(w)
                    grads.append(g)
        if tensors:  # through the weights' own graph (a dtype cast, FSDP's unsharded view) to .grad
            torch.autograd.backward(tensors, grads)

    def run_all(self) -> None:
        """Run every group's work now; the groups stay, empty, for the W actions still to come."""
        for _ in range(len(self._groups)):
            self.run_next()
            self._groups.append([])

    def __len__(self) -> int:
        return len(self._groups)


class _DeferWgrad(torch.autograd.Function):
    """y with a backward whose weight gradients a WeightGradQueue may defer. split = (forward(x,
    *weights) -> (y, saved), backward(saved, dy, need_dx) -> (dx, closure -> weights' grads)): the
    closure reads only what the forward saved, so under activation checkpointing one recompute serves
    both halves."""

    @staticmethod
    def forward(ctx, queue: WeightGradQueue, split: tuple, x, *weights):
        ctx.queue, ctx.split, ctx.weights = queue, split, weights
        y, saved = split[0](x, *weights)
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def backward(ctx, dy):
        need_dx, need_w = ctx.needs_input_grad[2], ctx.needs_input_grad[3:]
        weights = [w for w, need in zip(ctx.weights, need_w) if need]
        dx, split_wgrad = ctx.split[1](ctx.saved_tensors, dy, need_dx)
        wgrad = lambda: [g for g, need in zip(split_wgrad(), need_w) if need]
        if weights and ctx.queue.defer(tuple(weights), wgrad):
            return None, None, dx, *(None for _ in need_w)
        grads = iter(pith_ops.weight_grad(w, g) for w, g in zip(weights, wgrad()))
        return None, None, dx, *(next(grads) if need else None for need in need_w)


def defer_wgrad(
    queue: WeightGradQueue | None, forward: Callable, split: tuple, x: Tensor, *weights: Tensor
) -> Tensor:
    """forward(x, *weights), its weight gradients deferrable to `queue` (_DeferWgrad); under
    torch.compile (its backward cannot run Python) the plain call."""
    if torch.compiler.is_compiling() or queue is None:
        return forward(x, *weights)
    return _DeferWgrad.apply(queue, split, x, *weights)


def set_wgrad_queue(model: nn.Module, queue: WeightGradQueue | None) -> None:
    for m in model.modules():
        if isinstance(m, FP8Switch):
            m.wgrad_queue = queue


def split_linear_forward(x: Tensor, w_OI: Tensor, *bias_O: Tensor) -> tuple[Tensor, tuple]:
    """nn.functional.linear on operands cast as the caller's autocast would, kept for the backward."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    x_TI, w_OI = x.flatten(0, -2).to(dtype), w_OI.to(dtype)
    y_TO = nn.functional.linear(x_TI, w_OI, *(b.to(dtype) for b in bias_O))
    return y_TO.view(*x.shape[:-1], w_OI.shape[0]), (x_TI, w_OI, *bias_O)


def split_linear_backward(saved: tuple, dy: Tensor, need_dx: bool):
    """Autograd's linear backward (mm's, a contiguous weight) bit for bit: dx now, (dW, dbias) in the
    GEMM's dtype when called (pith_ops.weight_grad widens them)."""
    x_TI, w_OI, *bias_O = saved
    dy_TO = dy.flatten(0, -2)
    dx = None
    if need_dx:  # mm's backward multiplies transposed for a column-major x
        column_major = x_TI.stride() == (1, x_TI.shape[0])
        dx = (w_OI.t().mm(dy_TO.t()).t() if column_major else dy_TO.mm(w_OI)).reshape(
            *dy.shape[:-1], w_OI.shape[1]
        )
    return dx, lambda: (dy_TO.t().mm(x_TI), *(dy_TO.sum(0) for _ in bias_O))
