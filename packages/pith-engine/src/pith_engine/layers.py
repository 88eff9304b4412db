"""Building blocks that several model files share, so each model file keeps only its own math.

What is here is the same in every model that uses it: RMSNorm, the dense projections (Linear) and
SwiGLU MLP, the routed
SwiGLU experts (stage 3) and stage 5's weighted combine, the reference loop over experts, RoPE
tables (plain and YaRN), the embedding / final-norm / lm_head frame of a model, the seeded
normal initialiser, the weight-gradient queue that Linear and Experts can defer their weight
gradients to, the field checks closing every Config.from_hf, and the Hugging Face layout
conversion of the SwiGLU MLP and experts.
Parameter names are the checkpoints' and the engine's (`mlp.experts.w_gate_up`, `expert_bias`):
renaming one here renames it in every model.

Shape legend: B batch, S sequence, T = B*S tokens, D hidden, F (expert) MLP width, E experts
(those a module holds), K top-k, N rows grouped by expert, R rotary pairs, V vocabulary.
"""

import hashlib
import math
from collections import deque
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import MISSING, fields
from typing import Protocol

import pith_ops
import torch
import torch.distributed as dist
from pith_ops.fp8_grouped_gemm import backward as fp8_grouped_backward
from pith_ops.fp8_grouped_gemm import forward as fp8_grouped_forward
from pith_ops.fp8_grouped_gemm import fp8_grouped_gemm_weight
from pith_ops.fp8_linear import backward as fp8_linear_backward
from pith_ops.fp8_linear import forward as fp8_linear_forward
from pith_ops.fp8_linear import fp8_linear_weight
from pith_ops.fp8_quant import FP8Weight, weight_amax
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from pith_engine import executor
from pith_engine.contract import Positions, default_position_ids
from pith_engine.parallel import SINGLE, Mesh, expert_param_names, local_rows


class WeightGradQueue:
    """Weight-gradient work that backward passes left for later: a schedule's W slots run it.

    The step executor owns one and hands it to the modules that can defer (`set_wgrad_queue`). A
    backward run inside `with queue.deferring():` computes input gradients at once and leaves its
    weight-gradient work here as one group; `run_next()` runs the oldest group (one W action),
    accumulating into the parameters' .grad through the same autograd edges, bit for bit what the
    plain backward gives (tested). Outside `deferring()` the work runs inside the backward, as
    without a queue. Deferred work keeps the GEMM inputs and output gradients alive until it runs."""

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
        """-> whether the work was queued (inside deferring()); False: the caller runs it now."""
        if self._open is None:
            return False
        self._open.append((weights, wgrad))
        return True

    def run_next(self) -> None:
        """Run the oldest group of deferred work (a W action); the queue must not be empty."""
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
        n = len(self._groups)
        for _ in range(n):
            self.run_next()
            self._groups.append([])

    def __len__(self) -> int:
        return len(self._groups)


class _DeferWgrad(torch.autograd.Function):
    """y with a backward whose weight gradients a WeightGradQueue may defer. split = (forward_saving(x,
    *weights) -> (y, saved tensors), backward(saved, dy, need_dx) -> (dx or None, closure -> weights'
    grads)): the op's backward in two halves, the closure reading only what the forward saved, so under
    activation checkpointing one recompute serves both (a graph built in the forward and asked twice
    recomputed its checkpointed stage 10 to 14 times a micro-batch)."""

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
    """forward(x, *weights) (differentiable), its weight gradients deferrable to `queue` through the
    two halves of `split` (_DeferWgrad) and handed to the weights by pith_ops.weight_grad (a bf16
    gradient of a weight that keeps its gradients stays bf16, pith_ops.cast). Without a queue, or under
    torch.compile, whose traced backward cannot run Python: the plain call."""
    if torch.compiler.is_compiling() or queue is None:
        return forward(x, *weights)
    return _DeferWgrad.apply(queue, split, x, *weights)


def set_wgrad_queue(model: nn.Module, queue: WeightGradQueue | None) -> None:
    """Let every projection (Linear) and expert GEMM of `model` defer its weight gradients to `queue`
    (None: never)."""
    for m in model.modules():
        if isinstance(m, FP8Switch):
            m.wgrad_queue = queue


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, reference: bool = False) -> Tensor:
        norm = pith_ops.rms_norm_reference if reference else pith_ops.rms_norm
        return norm(x, self.weight, self.eps)


class GatheredFP8(Tensor):
    """A weight FSDP2 all-gathered in e4m3 (pith_engine.layers.gather_in_fp8): the unsharded parameter
    FSDP hands the module, of the weight's shape and compute dtype, holding no values in that dtype,
    only `copies` (an fp8_quant.FP8Weight: q in the weight's layout, its transposed copy, their
    scales), which the FP8 GEMMs read (FP8Switch.fp8_weight). Its gradient reaches it through a
    stand-in (pith_ops.stand_in); any other op on it is an error naming what to turn off."""

    copies: FP8Weight

    @staticmethod
    def __new__(cls, copies: FP8Weight, dtype: torch.dtype):
        t = Tensor._make_wrapper_subclass(cls, copies.q.shape, dtype=dtype, device=copies.q.device)
        t.copies = copies
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        w, aten = args[0], torch.ops.aten
        same_view = func is aten.as_strided.default and tuple(args[1]) == tuple(w.shape)  # FSDP's
        if func in (aten.detach.default, aten.alias.default) or same_view:
            return cls(w.copies, w.dtype)
        raise NotImplementedError(
            f"{func} on a weight FSDP gathered in FP8: only the FP8 GEMMs read it; set"
            " train.fp8_all_gather=false to use it otherwise"
        )


class FP8Switch:
    """A module whose GEMMs run in FP8 while `fp8` is set (use_fp8 sets it for a whole model), and
    whose weight gradients go to `wgrad_queue` when one is set (set_wgrad_queue). Its FP8 weights: a
    Linear's weight, an experts module's 3-D parameters."""

    fp8: bool = False
    wgrad_queue: WeightGradQueue | None = None

    @staticmethod
    def fp8_weight(w: Tensor, quantize: Callable[[Tensor], tuple]) -> tuple:
        """w's FP8 copies (quantize = pith_ops.fp8_*_weight, i.e. pith_ops.quantize_weight): its kept
        copies while valid (pith_ops.kept_copy), else quantize(w), kept (an fp8_quant.FP8Weight with
        w's amax) when w is a weight whose optimizer marks it (pith_ops.keep_grads: pith-train's AdamW,
        whose update pass rewrites them, pith_ops.adamw_). So a weight is quantised once, on its first
        forward; the micro-batches, recomputes and steps after read what the update pass wrote. Under
        FSDP2 the forward sees the all-gathered weight, not the optimizer's: quantised per call; under
        torch.compile too (a graph keeps no Python state)."""
        if isinstance(w, GatheredFP8):
            return w.copies[:4]
        if torch.compiler.is_compiling():
            return quantize(w)
        kept = pith_ops.kept_copy(w, torch.float8_e4m3fn)
        if kept is not None:
            return kept[:4]
        copies = quantize(w)
        if FP8Switch.keeps_copies(w) and torch.is_grad_enabled():
            pith_ops.keep(w, FP8Weight(*copies, weight_amax(w)), torch.float8_e4m3fn)
        return copies

    @staticmethod
    def keeps_copies(w: Tensor) -> bool:
        """Whether fp8_weight keeps w's FP8 copies (in eager code): w is a weight its optimizer marks and
        the optimizer's own tensor, not FSDP's sharded one."""
        return bool(w.__dict__.get("_pith_keep_grad")) and type(w) in (Tensor, nn.Parameter)


def use_fp8(model: nn.Module, enabled: bool = True, lm_head: bool = False) -> None:
    """Run every projection (Linear) and expert GEMM of `model` in FP8 (train.fp8): e4m3 operands with
    power-of-two scales (pith_ops.fp8_linear, fp8_grouped_gemm, the recipe in the pith-ops README),
    the weights quantised from their fp32 master copies, once, then by the optimizer's update pass
    (FP8Switch.fp8_weight). lm_head (a Linear the loss fuses: pith_engine.step.loss_sum) by its own
    switch (train.fp8_lm_head). Embeddings, norms, routers and attention stay in higher precision."""
    for name, m in model.named_modules():
        if isinstance(m, FP8Switch):
            m.fp8 = lm_head if name == "lm_head" else enabled


def gather_in_fp8(model: nn.Module, experts_only: bool = False) -> int:
    """Let FSDP2 all-gather the FP8 weights of `model` (those of FP8Switch modules with fp8 set) in e4m3
    (train.fp8_all_gather): 1 byte an element on the wire instead of bf16's 2, and no quantisation
    of the gathered weight. Each rank quantises its shard with the whole weight's scale (per expert
    for expert weights; the amax from one all-reduce of max over the shard group, a scalar or one per
    expert, per gather), and the unsharded parameter is a GatheredFP8 of the gathered copies. They are
    bit for bit what quantising the gathered fp32 weight gives (tested on gloo against an fp32
    policy); under a bf16 policy the bf16 rounding before quantisation is skipped. Weights not under
    FSDP stay as they are. experts_only: the experts' weights only (a compiled graph does not take a
    GatheredFP8; stage 3 is not compiled). Call after use_fp8 and before the first forward (FSDP's
    lazy init looks for the hooks, on the shard tensors that to_empty and checkpoint loads keep).
    -> how many weights FSDP will gather in e4m3 (0 where none is sharded)."""
    tied = {
        id(p) for m in model.modules() for p in m.parameters(recurse=False) if not isinstance(m, FP8Switch)
    }
    hooked = 0
    for name, m in model.named_modules():
        if not (isinstance(m, FP8Switch) and m.fp8) or (experts_only and isinstance(m, Linear)):
            continue
        for pname, p in fp8_weights(m):
            if not isinstance(p, DTensor):
                continue
            ranks = p.device_mesh.size()
            why = (
                "is shared with a module that does not quantise it" if id(p) in tied
                else f"does not shard evenly over {ranks} ranks" if p.shape[0] % ranks
                else "has rows not a multiple of 16 (CUDA's FP8 GEMMs)" if p.is_cuda and p.shape[-2] % 16
                else None
            )  # fmt: skip
            if why:
                raise ValueError(f"train.fp8_all_gather: {name}.{pname} {tuple(p.shape)} {why}; turn it off")
            local = p._local_tensor
            local.fsdp_pre_all_gather, local.fsdp_post_all_gather = _fp8_gather_hooks(local, tuple(p.shape))
            hooked += 1
    return hooked


def _fp8_gather_hooks(local: Tensor, shape: tuple):
    """FSDP2's all-gather extension hooks (looked up on the shard tensor) for one weight."""

    def pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy):
        held = local.shape[0]
        start = mesh.get_local_rank() * held
        amax = weight_amax(local)
        if len(shape) == 3:  # each rank's experts whole: their amaxes, zeros elsewhere
            amax = torch.zeros(shape[0], dtype=torch.float32, device=local.device).index_copy_(
                0, torch.arange(start, start + held, device=local.device), amax
            )
        dist.all_reduce(amax, dist.ReduceOp.MAX, group=mesh.get_group())
        own = amax[start : start + held] if len(shape) == 3 else amax
        q = pith_ops.quantize_weight(local.detach(), own)[0]
        return (q.view(torch.uint8),), amax

    def post_all_gather(outputs, amax, param_dtype, *, out=None):
        q = outputs[0].view(torch.float8_e4m3fn).view(shape)
        if out is not None:  # the same storages, refilled by FSDP: the copies rewritten in place
            out.copies = pith_ops.copies_of_quantized(q, amax, out.copies)
            return None
        copies = pith_ops.copies_of_quantized(q, amax)  # qt: unpadded (rows of 16), or a view of q
        return GatheredFP8(copies, param_dtype), (outputs[0], copies.qt)  # storages FSDP frees, refills

    return pre_all_gather, post_all_gather


def fp8_weights(m: FP8Switch) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of m's FP8 weights: a Linear's weight, an experts module's 3-D parameters."""
    return [
        (n, p) for n, p in m.named_parameters(recurse=False) if p.ndim == (2 if isinstance(m, Linear) else 3)
    ]


class Linear(FP8Switch, nn.Linear):
    """nn.Linear, through pith_ops.fp8_linear while fp8 is set (the FP8 weight copies cached per
    optimizer step: FP8Switch.fp8_weight). The model files' projections. Its weight gradients can be
    deferred (set_wgrad_queue), in FP8 too."""

    def forward(self, x: Tensor) -> Tensor:
        weights = (self.weight,) if self.bias is None else (self.weight, self.bias)
        if not self.fp8:
            split = (_linear_forward, _linear_backward)
            return defer_wgrad(self.wgrad_queue, nn.functional.linear, split, x, *weights)
        w8 = self.fp8_weight(self.weight, fp8_linear_weight)
        weights = (pith_ops.stand_in(self.weight, self.weight.dtype), *weights[1:])  # GatheredFP8's
        add_bias = lambda y, *bias: y + bias[0].to(y.dtype) if bias else y

        def split_forward(x_TD, w_OD, *bias):
            y, saved = fp8_linear_forward(x_TD, w_OD, w8)
            return add_bias(y, *bias), saved

        x_dtype = x.dtype  # not x: the backward keeps x8, a closure over x would keep x too

        def split_backward(saved, dy_TO, need_dx):
            dx, dw = fp8_linear_backward(saved, dy_TO, need_dx, x_dtype)
            return dx, lambda: (dw(), *(dy_TO.sum(0).to(b.dtype) for b in weights[1:]))

        plain = lambda x_TD, w_OD, *bias: add_bias(pith_ops.fp8_linear(x_TD, w_OD, w8), *bias)
        split = (split_forward, split_backward)
        y = defer_wgrad(self.wgrad_queue, plain, split, x.flatten(0, -2), *weights)
        return y.view(*x.shape[:-1], y.shape[-1])


def _linear_forward(x: Tensor, w_OI: Tensor, *bias_O: Tensor) -> tuple[Tensor, tuple]:
    """nn.functional.linear on operands cast as autocast would (a Function's forward runs under the
    caller's autocast), kept for _linear_backward."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    x_TI, w_OI = x.flatten(0, -2).to(dtype), w_OI.to(dtype)
    y_TO = nn.functional.linear(x_TI, w_OI, *(b.to(dtype) for b in bias_O))
    return y_TO.view(*x.shape[:-1], w_OI.shape[0]), (x_TI, w_OI, *bias_O)


def _linear_backward(saved: tuple, dy: Tensor, need_dx: bool):
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


def expert_gemm(
    x_ND: Tensor | pith_ops.FP8Rows,
    w_EIO: Tensor,
    group_ends_E: Tensor,
    fp8: bool,
    queue: WeightGradQueue | None = None,
    x8: tuple = (None, None),
) -> Tensor:
    """The experts' grouped GEMM: FP8 from the (fp32 master) weight's FP8 copies (FP8Switch.fp8_weight;
    x8: the rows' FP8 copy when the pass writing them made it, pith_ops.swiglu_fp8; x_ND FP8Rows: rows
    dispatched in FP8, executor.run_layer), or in the rows' dtype (bf16 rows under autocast meet fp32
    master weights; a no-op cast otherwise; pith_ops.cast for a vectorised cast of the gradient back,
    its docstring has the numbers), its weight gradient deferrable to `queue` either way."""
    if isinstance(x_ND, pith_ops.FP8Rows):
        if not fp8:  # its x is a stand-in: zeros
            raise ValueError(
                "expert_gemm: rows dispatched in FP8 (FP8Rows) need fp8=True (the experts' fp8 flag)"
            )
        x_ND, x8 = x_ND.x, (x_ND.q, x_ND.scale)
    if fp8:
        w8 = FP8Switch.fp8_weight(w_EIO, fp8_grouped_gemm_weight)
        # Not x_ND itself in the closure: the backward keeps the rows' FP8 copy, and a closure over the
        # bf16 rows kept them alive to the backward too (the pith-train bench: 2 GiB of permuted rows
        # and 0.8 GiB of SwiGLU outputs at its peak, H200).
        x_dtype = x_ND.dtype

        def split_backward(saved, dy_NO, need_dx):
            dx, dw = fp8_grouped_backward(saved, dy_NO, need_dx, x_dtype)
            return dx, lambda: (dw(),)

        split = (lambda x, w: fp8_grouped_forward(x, w, group_ends_E, w8, x8), split_backward)
        forward = lambda x, w: pith_ops.fp8_grouped_gemm(x, w, group_ends_E, w8, x8)
        return defer_wgrad(queue, forward, split, x_ND, pith_ops.stand_in(w_EIO, w_EIO.dtype))

    def split_backward(saved, dy_NO, need_dx):
        dx, wgrad = pith_ops.grouped_gemm_backward(*saved, group_ends_E, dy_NO, need_dx)
        return dx, lambda: (wgrad(),)

    forward = lambda x, w: pith_ops.grouped_gemm(x, w, group_ends_E)
    split = (lambda x, w: (forward(x, w), (x, w)), split_backward)
    return defer_wgrad(queue, forward, split, x_ND, pith_ops.cast(w_EIO, x_ND.dtype))


class MLP(nn.Module):
    """Dense SwiGLU; gate and up projections fused into one GEMM (gate | up halves)."""

    def __init__(self, D: int, F: int):
        super().__init__()
        self.gate_up_proj = Linear(D, 2 * F, bias=False)
        self.down_proj = Linear(F, D, bias=False)

    def forward(self, x: Tensor, reference: bool = False) -> Tensor:
        swiglu = pith_ops.swiglu_reference if reference else pith_ops.swiglu
        return self.down_proj(swiglu(self.gate_up_proj(x)))


class Experts(FP8Switch, nn.Module):
    """The routed SwiGLU experts, stage 3; a module of their own so the engine can shard them apart."""

    def __init__(self, E: int, D: int, F: int):
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.empty(E, D, 2 * F))  # [E_held, D, 2F]: gate | up halves
        self.w_down = nn.Parameter(torch.empty(E, F, D))  # [E_held, F, D]

    def forward(self, x_ND: Tensor, group_ends_E: Tensor) -> Tensor:
        gemm = lambda x, w, *x8: expert_gemm(x, w, group_ends_E, self.fp8, self.wgrad_queue, *x8)
        h_N2F = gemm(x_ND, self.w_gate_up)
        if self.fp8:  # SwiGLU writes the down projection's FP8 rows too (one pass less over them)
            a_NF, *x8 = pith_ops.swiglu_fp8(h_N2F)
            return gemm(a_NF, self.w_down, x8)
        return gemm(pith_ops.swiglu(h_N2F), self.w_down)

    def reference(self, x_TD: Tensor, expert_ids_TK: Tensor, weights_TK: Tensor) -> Tensor:
        w_gate_up, w_down = self.w_gate_up, self.w_down
        expert = lambda e, x: pith_ops.swiglu_reference(x @ w_gate_up[e]) @ w_down[e]
        return routed_reference(x_TD, expert_ids_TK, weights_TK, w_gate_up.shape[0], expert)


def routed_reference(
    x_TD: Tensor, expert_ids_TK: Tensor, weights_TK: Tensor, E: int, expert: Callable[[int, Tensor], Tensor]
) -> Tensor:
    """Stages 2 to 5 unstaged: expert(e, rows) over each expert's tokens in a loop, weighted sum in fp32
    (fp64 for a float64 model, whose routing weights are fp64)."""
    out_TD = torch.zeros_like(x_TD, dtype=torch.promote_types(weights_TK.dtype, torch.float32))
    for e in range(E):
        t, k = (expert_ids_TK == e).nonzero(as_tuple=True)
        out_TD = out_TD.index_add(0, t, expert(e, x_TD[t]).float() * weights_TK[t, k, None])
    return out_TD.to(x_TD.dtype)


class Router(nn.Linear):
    """The routing linear: logits [T, E] in fp32 (fp64 for a float64 model, tests) whatever the dtype
    of its input and weight (bf16 weights, bf16 autocast): bf16 keeps ~3 significant digits, enough to
    flip near-tied top-k choices. A module of its own, so FSDP can gather its weight in fp32 (its own
    unit, pith_engine.parallel)."""

    def forward(self, x_TD: Tensor) -> Tensor:
        dtype = torch.promote_types(self.weight.dtype, torch.float32)
        bias = None if self.bias is None else self.bias.to(dtype)
        with torch.autocast(x_TD.device.type, enabled=False):
            return nn.functional.linear(x_TD.to(dtype), self.weight.to(dtype), bias)


def combine(h_BSD: Tensor, y_ND: Tensor, slots_TK: Tensor, weights_TK: Tensor) -> Tensor:
    """Stage 5: h + sum_k weights[t, k] * y[slots[t, k]] (a slot < 0 contributes nothing)."""
    return h_BSD + pith_ops.moe_unpermute(y_ND, slots_TK, weights_TK).view_as(h_BSD)


class YarnParams(Protocol):
    """The YaRN fields the frequency blend reads (each model's Yarn config has them)."""

    factor: float  # context extension factor
    original_max_position_embeddings: int  # pretraining context length
    beta_fast: float  # rotations bounding the extrapolated (high-frequency) band
    beta_slow: float  # rotations bounding the interpolated (low-frequency) band
    truncate: bool  # round the blend range to whole dims


def rope_inv_freq(theta: float, dim: int, device: torch.device, yarn: YarnParams | None = None) -> Tensor:
    """Inverse frequencies [R = dim/2] in fp64 of RoPE with base theta over `dim` rotary dims, with
    YaRN's blend of the original and the interpolated (divided by factor) frequencies when given."""
    inv_freq_R = theta ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim)
    if yarn is None:
        return inv_freq_R

    def dim_of(rotations: float) -> float:  # the (fractional) dim completing `rotations` turns in context
        wavelengths = yarn.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(wavelengths) / (2 * math.log(theta))

    low, high = dim_of(yarn.beta_fast), dim_of(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp_R = ((torch.arange(dim // 2, device=device, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    # High-frequency dims (ramp 0) keep their frequency; low-frequency ones (ramp 1) are interpolated.
    return inv_freq_R * (1 - ramp_R) + inv_freq_R / yarn.factor * ramp_R


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor 0.1 * mscale * ln(factor) + 1 (1 without extension)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rotary_positions(
    position_ids_BS: Tensor, inv_freq_R: Tensor, cp_group: ProcessGroup | None, scale: float = 1.0
) -> Positions:
    """The rotary cos/sin tables (times `scale`, YaRN's attention factor) for these positions."""
    # Angles in fp64: fp32 position * frequency loses ~1e-3 rad at positions near 32K.
    angle_BSR = position_ids_BS.double()[..., None] * inv_freq_R
    cos_BSR, sin_BSR = (angle_BSR.cos() * scale).float(), (angle_BSR.sin() * scale).float()
    return Positions(position_ids_BS, cos_BSR, sin_BSR, cp_group)


class DecoderModel(nn.Module):
    """The frame of a pith_engine.contract.MoEModel: embed_tokens, the decoder layers, the final
    RMSNorm `norm` and lm_head (tied to the embedding when cfg.tie_word_embeddings). A model file
    subclasses it, passing `make_layer(i)` (the layer of global index i), and defines `positions`
    (its rotary tables), which reference_forward calls.

    layer_ids: the global indices of the layers to build (None: all of cfg.num_hidden_layers). The
    layers sit in an nn.ModuleDict keyed by str(global index), in increasing order, so a model built
    with only some of them (a pipeline rank's chunks, which need not be adjacent) keeps the names
    `layers.<i>.` of the whole model: state dicts and checkpoints are layout-independent."""

    def __init__(self, cfg, make_layer: Callable[[int], nn.Module], layer_ids: Iterable[int] | None = None):
        super().__init__()
        L = cfg.num_hidden_layers
        ids = range(L) if layer_ids is None else sorted(set(layer_ids))
        if any(not 0 <= i < L for i in ids):
            raise ValueError(f"layer_ids {list(ids)}: a model of {L} layers has indices 0..{L - 1}")
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): make_layer(i) for i in ids})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def prologue(self, input_ids_BS: Tensor) -> Tensor:
        return self.embed_tokens(input_ids_BS)

    def epilogue(self, h_BSD: Tensor) -> Tensor:
        return self.norm(h_BSD)

    def forward(self, input_ids_BS: Tensor) -> Tensor:
        """model(input_ids) -> logits [B, S, V]: the staged path (executor.forward, every expert on
        this process), i.e. the function the trainer optimises, with its kernels; reference_forward
        stays the plain-PyTorch specification that the tests hold it to."""
        h_BSD, _ = executor.forward(self, input_ids_BS, executor.LocalExperts())
        return self.lm_head(h_BSD)

    def reference_forward(self, input_ids_BS: Tensor) -> Tensor:
        pos = self.positions(default_position_ids(input_ids_BS))
        h_BSD = self.embed_tokens(input_ids_BS)
        for layer in self.layers.values():
            h_BSD = layer.reference_forward(h_BSD, pos)
        return self.lm_head(self.norm(h_BSD, True))


def _generator(device: torch.device, seed: int, key: str) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return torch.Generator(device).manual_seed(int.from_bytes(digest) >> 1)


@torch.no_grad()
def init_normal(
    model: nn.Module, seed: int, std: float, zero: tuple[str, ...] = (), mesh: Mesh = SINGLE
) -> None:
    """Norm weights 1, parameters named ending in one of `zero` 0, expert_bias buffers 0, every other
    parameter N(0, std), whatever the layout: each tensor of the canonical checkpoint layout (a
    parameter, or one expert of a stacked expert weight: `name.<global expert>`) draws from its own
    generator seeded by (seed, its name), so one process and every dp/cp/ep/pp layout hold the same
    global weights, and a rank draws only the pieces it holds (a dense parameter whole, once, then
    its FSDP rows kept; an expert only where this rank holds it). `model` may be sharded by
    pith_engine.parallel.parallelize over `mesh`, after materialising (model.to_empty)."""
    if next(model.parameters()).device.type == "meta":
        raise ValueError("the model is on the meta device: materialise it (model.to_empty(device=...)) first")
    experts = expert_param_names(model)
    for name, p in model.named_parameters():
        local, rows = local_rows(p)
        if name.endswith("norm.weight"):
            local.fill_(1.0)
        elif name.endswith(zero):
            local.zero_()
        elif name in experts:  # dim 0: this EP rank's experts, of which FSDP keeps `rows`
            for j, r in enumerate(rows):
                e = mesh.ep_rank * p.shape[0] + r
                local[j].normal_(0.0, std, generator=_generator(local.device, seed, f"{name}.{e}"))
        else:
            full = torch.empty(p.shape, device=local.device).normal_(
                0.0, std, generator=_generator(local.device, seed, name)
            )
            local.copy_(full[rows.start : rows.stop])
    for name, b in model.named_buffers():
        if name.endswith("expert_bias"):
            b.zero_()


def config_kwargs_from_hf(d: dict, cls: type, fixed: dict, ignored: tuple[str, ...]) -> dict:
    """The checks every Config.from_hf ends with, on config.json's dict once the model converted its
    own fields: a `fixed` field (its other values would change the math) holding another value, a
    field the dataclass `cls` lacks, or a required field absent is a ValueError naming it; `ignored`
    fields (no effect on the math) are dropped. -> the keyword arguments of cls."""
    d = {k: v for k, v in d.items() if k not in ignored}
    for key, allowed in fixed.items():
        if key in d and d.pop(key) != allowed:
            raise ValueError(f"config field {key}: only {allowed!r} is supported")
    unknown = sorted(set(d) - {f.name for f in fields(cls)})
    if unknown:
        raise ValueError(f"unsupported {cls.model_type} config fields: {unknown}")
    missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in d]
    if missing:
        raise ValueError(f"{cls.model_type} config lacks required fields: {missing}")
    return d


def yarn_params_from_hf(d: dict, default_theta: float, yarn_cls: type) -> tuple[float, dict | None]:
    """Pop rope_parameters (transformers 5) or rope_scaling + rope_theta (4.x) from config.json's dict
    -> (theta, the YaRN parameters; None for the default rope). Another rope type, a parameter of the
    default rope or a YaRN parameter that is no field of the dataclass `yarn_cls` is a ValueError."""
    rope = dict(d.pop("rope_parameters", None) or d.pop("rope_scaling", None) or {})
    theta = float(rope.pop("rope_theta", d.pop("rope_theta", default_theta)))
    d.pop("rope_scaling", None)
    rope_type = rope.pop("rope_type", rope.get("type", "default"))
    rope.pop("type", None)
    if rope_type == "default":
        if rope:
            raise ValueError(f"unsupported parameters of the default rope: {sorted(rope)}")
        return theta, None
    if rope_type != "yarn":
        raise ValueError(f"rope type {rope_type!r} is not supported (only default and yarn)")
    unknown = sorted(set(rope) - {f.name for f in fields(yarn_cls)})
    if unknown:
        raise ValueError(f"unsupported yarn rope parameters: {unknown}")
    return theta, rope


def from_hf_swiglu_state_dict(
    sd: dict[str, Tensor], moe_layers: Iterable[int], E: int, tie_word_embeddings: bool, experts: range
) -> dict[str, Tensor]:
    """Hugging Face names and layouts -> ours for a model whose MLPs are MLP and Experts: every
    gate_proj / up_proj pair [F, D] fuses into gate_up_proj [2F, D]; the per-expert [out, in]
    weights of layers.{i}.mlp.experts.{e}, e in `experts`, stack into w_gate_up [len(experts), D, 2F]
    and w_down [len(experts), F, D]; each MoE layer gets a zero expert_bias [E]. Assumes a complete
    input (hf.py checks it first)."""
    out = {}
    for k, v in sd.items():
        name = k.removeprefix("model.")
        if ".experts." in name or name.endswith(".up_proj.weight"):
            continue
        if name.endswith(".gate_proj.weight"):
            up = sd[k.replace(".gate_proj.", ".up_proj.")]
            out[name.replace(".gate_proj.", ".gate_up_proj.")] = torch.cat((v, up))
        else:
            out[name] = v
    for i in moe_layers:
        hf, ours = f"model.layers.{i}.mlp.experts.", f"layers.{i}.mlp."
        held = [f"{hf}{e}." for e in experts]
        out[ours + "experts.w_gate_up"] = torch.stack(
            [torch.cat((sd[x + "gate_proj.weight"].T, sd[x + "up_proj.weight"].T), dim=1) for x in held]
        )
        out[ours + "experts.w_down"] = torch.stack([sd[x + "down_proj.weight"].T for x in held])
        out[ours + "expert_bias"] = torch.zeros(E, dtype=torch.float32)
    if tie_word_embeddings:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


def to_hf_swiglu_state_dict(sd: dict[str, Tensor], tie_word_embeddings: bool, hf_name: str) -> dict:
    """The inverse of from_hf_swiglu_state_dict. A nonzero expert_bias is a ValueError: the Hugging
    Face architecture (`hf_name`, for the message) has no selection-only bias to export it to."""
    out = {}
    for k, v in sd.items():
        prefix = k.rpartition(".")[0] + "."
        if k.endswith("expert_bias"):
            if not v.is_meta and bool(v.any()):
                raise ValueError(f"{k} is nonzero: HF {hf_name} has no routing bias to export it to")
        elif k.endswith("mlp.experts.w_gate_up"):
            for e in range(v.shape[0]):
                gate, up = v[e].chunk(2, dim=-1)
                out[f"model.{prefix}{e}.gate_proj.weight"] = gate.T
                out[f"model.{prefix}{e}.up_proj.weight"] = up.T
        elif k.endswith("mlp.experts.w_down"):
            for e in range(v.shape[0]):
                out[f"model.{prefix}{e}.down_proj.weight"] = v[e].T
        elif k.endswith("gate_up_proj.weight"):
            gate, up = v.chunk(2)
            out[f"model.{prefix.removesuffix('gate_up_proj.')}gate_proj.weight"] = gate
            out[f"model.{prefix.removesuffix('gate_up_proj.')}up_proj.weight"] = up
        elif k == "lm_head.weight":
            if not tie_word_embeddings:
                out[k] = v
        else:
            out["model." + k] = v
    return out
