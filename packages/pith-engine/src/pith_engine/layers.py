"""Building blocks the model files share. Parameter names are the checkpoints' and the engine's:
renaming one here renames it in every model.

Shape legend: B batch, S sequence, T = B*S tokens, D hidden, E experts (those a module holds), K
top-k, N rows grouped by expert, R rotary pairs, V vocabulary.
"""

import hashlib
import math
from collections.abc import Callable
from typing import Protocol

import pith_ops
import torch
from pith_ops.fp8_grouped_gemm import backward as fp8_grouped_backward
from pith_ops.fp8_grouped_gemm import forward as fp8_grouped_forward
from pith_ops.fp8_grouped_gemm import fp8_grouped_gemm_weight
from pith_ops.fp8_linear import backward as fp8_linear_backward
from pith_ops.fp8_linear import forward as fp8_linear_forward
from pith_ops.fp8_linear import fp8_linear_weight
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from pith_engine import executor
from pith_engine.contract import Positions, model_positions
from pith_engine.fp8 import FP8Switch
from pith_engine.parallel import SINGLE, Mesh, expert_param_names, held_experts, local_rows
from pith_engine.wgrad import WeightGradQueue, defer_wgrad, split_linear_backward, split_linear_forward


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, reference: bool = False) -> Tensor:
        return (pith_ops.rms_norm_reference if reference else pith_ops.rms_norm)(x, self.weight, self.eps)


class Linear(FP8Switch, nn.Linear):
    """nn.Linear, through pith_ops.fp8_linear while fp8 is set; its weight gradients deferrable."""

    weight_ndim = 2

    def forward(self, x: Tensor) -> Tensor:
        weights = (self.weight,) if self.bias is None else (self.weight, self.bias)
        if not self.fp8:
            split = (split_linear_forward, split_linear_backward)
            return defer_wgrad(self.wgrad_queue, nn.functional.linear, split, x, *weights)
        w8 = self.fp8_weight(self.weight, fp8_linear_weight)
        # A stand-in in x's dtype (eager), so the weight holds its bf16 gradient (pith_ops.weight_grad);
        # under compile the weight itself (the traced graph takes no stand-in).
        dtype = self.weight.dtype if torch.compiler.is_compiling() else x.dtype
        weights = (pith_ops.stand_in(self.weight, dtype), *weights[1:])
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


def expert_gemm(
    x_ND: Tensor | pith_ops.FP8Rows,
    w_EIO: Tensor,
    group_ends_E: Tensor,
    fp8: bool,
    queue: WeightGradQueue | None = None,
    x8: tuple = (None, None),
) -> Tensor:
    """The experts' grouped GEMM, its weight gradient deferrable to `queue`; in FP8 when fp8 (x8: the
    rows' FP8 copy if the pass writing them made one), else in the rows' dtype."""
    if isinstance(x_ND, pith_ops.FP8Rows):
        if not fp8:  # its x is a stand-in: zeros
            raise ValueError(
                "expert_gemm: rows dispatched in FP8 (FP8Rows) need fp8=True (the experts' fp8 flag)"
            )
        x_ND, x8 = x_ND.x, (x_ND.q, x_ND.scale)
    if fp8:
        w8 = FP8Switch.fp8_weight(w_EIO, fp8_grouped_gemm_weight)
        # Not x_ND in the closure: it kept the bf16 rows alive to the backward beside their FP8 copy
        # (2.8 GiB at the bench's peak, H200).
        x_dtype = x_ND.dtype

        def split_backward(saved, dy_NO, need_dx):
            dx, dw = fp8_grouped_backward(saved, dy_NO, need_dx, x_dtype)
            return dx, lambda: (dw(),)

        split = (lambda x, w: fp8_grouped_forward(x, w, group_ends_E, w8, x8), split_backward)
        forward = lambda x, w: pith_ops.fp8_grouped_gemm(x, w, group_ends_E, w8, x8)
        # In the rows' dtype, as the bf16 path's cast: the weight holds its bf16 gradient, not widened
        # into .grad (pith-train README, the FP8 regression).
        return defer_wgrad(queue, forward, split, x_ND, pith_ops.stand_in(w_EIO, x_dtype))

    def split_backward(saved, dy_NO, need_dx):
        dx, wgrad = pith_ops.grouped_gemm_backward(*saved, group_ends_E, dy_NO, need_dx)
        return dx, lambda: (wgrad(),)

    forward = lambda x, w: pith_ops.grouped_gemm(x, w, group_ends_E)
    split = (lambda x, w: (forward(x, w), (x, w)), split_backward)
    return defer_wgrad(queue, forward, split, x_ND, pith_ops.cast(w_EIO, x_ND.dtype))


def routed_reference(
    x_TD: Tensor, expert_ids_TK: Tensor, weights_TK: Tensor, E: int, expert: Callable[[int, Tensor], Tensor]
) -> Tensor:
    """Stages 2 to 5 unstaged, summed in fp32 (fp64 for a float64 model)."""
    out_TD = torch.zeros_like(x_TD, dtype=torch.promote_types(weights_TK.dtype, torch.float32))
    for e in range(E):
        t, k = (expert_ids_TK == e).nonzero(as_tuple=True)
        out_TD = out_TD.index_add(0, t, expert(e, x_TD[t]).float() * weights_TK[t, k, None])
    return out_TD.to(x_TD.dtype)


class Router(nn.Linear):
    """The routing linear: logits [T, E] in fp32 (fp64 for a float64 model) whatever the dtypes of
    input and weight: bf16 keeps ~3 significant digits, enough to flip near-tied top-k choices. A
    module of its own, so FSDP can gather its weight in fp32 (pith_engine.parallel)."""

    def forward(self, x_TD: Tensor) -> Tensor:
        dtype = torch.promote_types(self.weight.dtype, torch.float32)
        bias = None if self.bias is None else self.bias.to(dtype)
        with torch.autocast(x_TD.device.type, enabled=False):
            return nn.functional.linear(x_TD.to(dtype), self.weight.to(dtype), bias)


class YarnParams(Protocol):
    """The YaRN fields the frequency blend reads."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    truncate: bool


def rope_inv_freq(theta: float, dim: int, device: torch.device, yarn: YarnParams | None = None) -> Tensor:
    """RoPE's inverse frequencies [R = dim/2] in fp64, YaRN's blend when given."""
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
    # Angles in fp64: fp32 position * frequency loses ~1e-3 rad at positions near 32K.
    angle_BSR = position_ids_BS.double()[..., None] * inv_freq_R
    cos_BSR, sin_BSR = (angle_BSR.cos() * scale).float(), (angle_BSR.sin() * scale).float()
    return Positions(position_ids_BS, cos_BSR, sin_BSR, cp_group)


class DecoderModel(nn.Module):
    """The frame of a pith_engine.contract.MoEModel; a model file subclasses it with `make_layer(i)`
    and defines `positions`. Layers are keyed by str(index), so a pipeline rank's model keeps the whole
    one's names."""

    def __init__(self, cfg, make_layer: Callable[[int], nn.Module]):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): make_layer(i) for i in range(cfg.num_hidden_layers)})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def prologue(self, input_ids_BS: Tensor) -> Tensor:
        return self.embed_tokens(input_ids_BS)

    def epilogue(self, h_BSD: Tensor) -> Tensor:
        return self.norm(h_BSD)

    def forward(self, input_ids_BS: Tensor, position_ids_BS: Tensor | None = None) -> Tensor:
        """-> logits [B, S, V] through the staged path, every expert local."""
        h_BSD, _ = executor.forward(self, input_ids_BS, executor.LocalExperts(), position_ids_BS)
        return self.lm_head(h_BSD)

    def reference_forward(self, input_ids_BS: Tensor, position_ids_BS: Tensor | None = None) -> Tensor:
        pos = model_positions(self, input_ids_BS, position_ids_BS)
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
    """Norm weights 1, parameters named ending in `zero` 0, expert_bias 0, others N(0, std), each
    tensor of the checkpoint layout seeded by (seed, its name) (pith-engine README, Parallelism)."""
    if next(model.parameters()).device.type == "meta":
        raise ValueError("the model is on the meta device: materialise it (model.to_empty(device=...)) first")
    experts = expert_param_names(model)
    for name, p in model.named_parameters():
        local, rows = local_rows(p)
        if name.endswith("norm.weight"):
            local.fill_(1.0)
        elif name.endswith(zero):
            local.zero_()
        elif name in experts:  # this EP rank's experts that FSDP keeps here
            for e, x in held_experts(p, mesh):
                x.normal_(0.0, std, generator=_generator(local.device, seed, f"{name}.{e}"))
        else:
            full = torch.empty(p.shape, device=local.device).normal_(
                0.0, std, generator=_generator(local.device, seed, name)
            )
            local.copy_(full[rows.start : rows.stop])
    for name, b in model.named_buffers():
        if name.endswith("expert_bias"):
            b.zero_()
