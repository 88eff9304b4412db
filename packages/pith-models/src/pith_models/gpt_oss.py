"""GPT-OSS (openai/gpt-oss-20b, gpt-oss-120b), as transformers' GptOss.

Architectural choices:
- pre-norm decoder, every layer MoE;
- grouped-query attention, q/k/v/o biases, free head_dim, scale head_dim**-0.5, a trained sink logit
  per head in every softmax denominator; layers sliding-window (key visible when pos_q - pos_k <
  sliding_window) or full causal as layer_types says;
- RoPE on the whole head dim, half-split pairs, YaRN (inverse frequencies blended between
  interpolation and extrapolation, cos and sin times 0.1 * ln(factor) + 1);
- router: linear with bias, fp32 logits; top-k over logits + `expert_bias`; weights = softmax of the
  k chosen logits;
- experts: clamped SwiGLU on interleaved gate/up columns (pith_ops.swiglu_oss), a bias after each
  projection, gathered per row by its expert.

Shape legend: B batch, S sequence, T = B*S, D hidden, H / G query / kv heads, Dh head dim, R = Dh/2, E
experts (E_held: held here), F expert width, K top-k, N rows grouped by expert, V vocabulary.
"""

from dataclasses import asdict, dataclass
from typing import ClassVar

import pith_ops
import torch
from pith_engine.attention import attention
from pith_engine.contract import Positions, Routing, Stage1Out
from pith_engine.fp8 import FP8Switch
from pith_engine.layers import (
    DecoderModel,
    Linear,
    RMSNorm,
    Router,
    expert_gemm,
    init_normal,
    rope_inv_freq,
    rotary_positions,
    routed_reference,
    yarn_mscale,
)
from pith_engine.parallel import SINGLE, Mesh
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from pith_models.hf_convert import check_ranges, config_kwargs_from_hf, hf_fields, yarn_params_from_hf

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Yarn:
    """YaRN rope scaling, HF rope parameter names (no mscale)."""

    factor: float = 32.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0  # rotations bounding the extrapolated band
    beta_slow: float = 1.0  # rotations bounding the interpolated band
    truncate: bool = False  # round the blend range to whole dims


@dataclass(frozen=True)
class Config:
    model_type: ClassVar[str] = "gpt_oss"  # HF model_type

    vocab_size: int  # V
    hidden_size: int  # D
    intermediate_size: int  # F
    num_hidden_layers: int  # decoder layers
    num_attention_heads: int  # H
    num_key_value_heads: int  # G
    head_dim: int  # Dh (even)
    num_local_experts: int  # E
    num_experts_per_tok: int  # K
    sliding_window: int  # of sliding layers
    layer_types: tuple[str, ...] = ()  # per layer SLIDING | FULL; () alternates
    rms_norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 150_000.0  # RoPE base
    yarn: Yarn | None = Yarn()  # None: plain RoPE
    swiglu_alpha: float = 1.702  # SwiGLU sigmoid gain
    swiglu_limit: float = 7.0  # clamp of gate (above) and up (both sides)
    tie_word_embeddings: bool = False  # lm_head.weight is embed_tokens.weight
    max_position_embeddings: int = 131072  # no effect on the math
    initializer_range: float = 0.02  # std of init_weights' draws

    def __post_init__(self):
        check_ranges(self)
        L, H, G = self.num_hidden_layers, self.num_attention_heads, self.num_key_value_heads
        E, K = self.num_local_experts, self.num_experts_per_tok
        types = tuple(self.layer_types or [(SLIDING, FULL)[i % 2] for i in range(L)])  # transformers' default
        object.__setattr__(self, "layer_types", types)
        if len(types) != L or not set(types) <= {SLIDING, FULL}:
            raise ValueError(
                f"layer_types must hold num_hidden_layers={L} entries of {SLIDING!r} or {FULL!r}, "
                f"got {list(types)}"
            )
        if H % G:
            raise ValueError(f"num_attention_heads ({H}) must be a multiple of num_key_value_heads ({G})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not 1 <= K <= E:
            raise ValueError(f"num_experts_per_tok must be in [1, num_local_experts={E}], got {K}")
        if not isinstance(self.sliding_window, int):
            raise ValueError(f"sliding_window must be an int, got {self.sliding_window!r}")

    @classmethod
    def from_hf(cls, d: dict) -> "Config":
        d = hf_fields(d, cls)
        quant = d.pop("quantization_config", {"quant_method": "mxfp4"}).get("quant_method")
        if quant != "mxfp4":  # dequantised as read (pith_models.hf)
            raise ValueError(f"config field quantization_config: quant_method {quant!r}; only mxfp4 loads")
        d["rope_theta"], d["yarn"] = _rope_from_hf(d)
        return cls(**config_kwargs_from_hf(d, cls, _FIXED, _IGNORED))

    def to_hf(self) -> dict:
        d = asdict(self)
        yarn = d.pop("yarn")
        rope = {"rope_type": "yarn" if yarn else "default", "rope_theta": d.pop("rope_theta"), **(yarn or {})}
        return {
            "model_type": self.model_type, "architectures": ["GptOssForCausalLM"], **d, **_FIXED,
            "layer_types": list(self.layer_types), "rope_parameters": rope,
        }  # fmt: skip


_FIXED = {"attention_bias": True, "attention_dropout": 0.0}
# Not changing the math: hidden_act (transformers' GPT-OSS always clamps) and the release's duplicates.
_IGNORED = ("hidden_act", "experts_per_token", "initial_context_length", "_name_or_path")


def _rope_from_hf(d: dict) -> tuple[float, Yarn | None]:
    """-> (theta, yarn); neither rope_parameters nor rope_scaling: transformers' default, Yarn()."""
    if "rope_parameters" not in d and "rope_scaling" not in d:
        return float(d.pop("rope_theta", 150_000.0)), Yarn()
    theta, rope = yarn_params_from_hf(d, 150_000.0, Yarn)
    if rope is None:
        return theta, None
    # transformers' defaults
    rope.setdefault("truncate", True)
    rope.setdefault("original_max_position_embeddings", d.get("max_position_embeddings", 131072))
    return theta, Yarn(**{k: v for k, v in rope.items() if v is not None})


def rope_frequencies(cfg: Config, device: torch.device) -> tuple[Tensor, float]:
    """-> (inverse frequencies [R] fp64, cos/sin factor)."""
    inv_freq_R = rope_inv_freq(cfg.rope_theta, cfg.head_dim, device, cfg.yarn)
    return inv_freq_R, (1.0 if cfg.yarn is None else yarn_mscale(cfg.yarn.factor))


class Attention(nn.Module):
    def __init__(self, cfg: Config, i: int):
        super().__init__()
        D, H, G, Dh = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.H, self.G, self.Dh = H, G, Dh
        self.window = cfg.sliding_window if cfg.layer_types[i] == SLIDING else None
        self.q_proj = Linear(D, H * Dh)
        self.k_proj = Linear(D, G * Dh)
        self.v_proj = Linear(D, G * Dh)
        self.o_proj = Linear(H * Dh, D)
        self.sinks = nn.Parameter(torch.empty(H))

    def forward(self, x_BSD: Tensor, pos: Positions, reference: bool = False) -> Tensor:
        B, S, _ = x_BSD.shape
        apply = pith_ops.apply_rope_reference if reference else pith_ops.apply_rope
        rope = lambda x, n: apply(x.view(B, S, n, self.Dh), pos.cos_BSR, pos.sin_BSR)
        q_BSHD, k_BSGD = rope(self.q_proj(x_BSD), self.H), rope(self.k_proj(x_BSD), self.G)
        v_BSGD = self.v_proj(x_BSD).view(B, S, self.G, self.Dh)
        kw = dict(scale=self.Dh**-0.5, window=self.window, sinks_H=self.sinks, reference=reference)
        o_BSHD = attention(q_BSHD, k_BSGD, v_BSGD, pos, **kw)
        return self.o_proj(o_BSHD.reshape(B, S, self.H * self.Dh))


class Experts(FP8Switch, nn.Module):
    """Stage 3, biases included: one module for the engine to shard."""

    def __init__(self, E: int, D: int, F: int, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.w_gate_up = nn.Parameter(torch.empty(E, D, 2 * F))  # gate, up interleaved
        self.b_gate_up = nn.Parameter(torch.empty(E, 2 * F))  # likewise
        self.w_down = nn.Parameter(torch.empty(E, F, D))
        self.b_down = nn.Parameter(torch.empty(E, D))

    def forward(self, x_ND: Tensor | pith_ops.FP8Rows, group_ends_E: Tensor) -> Tensor:
        x = x_ND.x if isinstance(x_ND, pith_ops.FP8Rows) else x_ND
        # Each row's expert; rows past the last end are padding (any expert does).
        rows_N = torch.arange(x.shape[0], device=x.device, dtype=group_ends_E.dtype)
        expert_N = torch.searchsorted(group_ends_E, rows_N, right=True).clamp(max=group_ends_E.shape[0] - 1)
        # bf16 rows under autocast meet fp32 master biases.
        b_gate_up, b_down = self.b_gate_up.to(x.dtype), self.b_down.to(x.dtype)
        gemm = lambda x, w: expert_gemm(x, w, group_ends_E, self.fp8, self.wgrad_queue)
        h_N2F = gemm(x_ND, self.w_gate_up) + b_gate_up[expert_N]
        h_NF = pith_ops.swiglu_oss(h_N2F, self.alpha, self.limit)
        return gemm(h_NF, self.w_down) + b_down[expert_N]

    def reference(self, x_TD: Tensor, expert_ids_TK: Tensor, weights_TK: Tensor) -> Tensor:
        def expert(e: int, x: Tensor) -> Tensor:
            h = x @ self.w_gate_up[e] + self.b_gate_up[e]
            return pith_ops.swiglu_oss_reference(h, self.alpha, self.limit) @ self.w_down[e] + self.b_down[e]

        return routed_reference(x_TD, expert_ids_TK, weights_TK, self.w_gate_up.shape[0], expert)


class MoE(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        D, E, F = cfg.hidden_size, cfg.num_local_experts, cfg.intermediate_size
        self.top_k = cfg.num_experts_per_tok
        self.router = Router(D, E)
        self.experts = Experts(E, D, F, cfg.swiglu_alpha, cfg.swiglu_limit)
        self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32))

    def route(self, x_TD: Tensor) -> Routing:
        logits_TE = self.router(x_TD)
        expert_ids_TK = torch.topk(logits_TE.detach() + self.expert_bias, self.top_k, dim=-1).indices
        weights_TK = logits_TE.gather(1, expert_ids_TK).softmax(-1)
        return Routing(x_TD, expert_ids_TK, weights_TK, logits_TE.softmax(-1), logits_TE)

    def reference(self, x_BSD: Tensor) -> Tensor:
        r = self.route(x_BSD.flatten(0, 1))
        return self.experts.reference(r.x_TD, r.expert_ids_TK, r.weights_TK).view_as(x_BSD)


class Layer(nn.Module):
    def __init__(self, cfg: Config, i: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, i)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg)

    @property
    def experts(self) -> Experts:
        return self.mlp.experts

    @property
    def router(self) -> Router:
        return self.mlp.router

    def stage1(self, h_BSD: Tensor, pos: Positions) -> Stage1Out:
        h_BSD = h_BSD + self.self_attn(self.input_layernorm(h_BSD), pos)
        return Stage1Out(h_BSD, self.mlp.route(self.post_attention_layernorm(h_BSD).flatten(0, 1)))

    def stage3(self, x_ND: Tensor, group_ends_E: Tensor) -> Tensor:
        return self.experts(x_ND, group_ends_E)

    def stage5(self, h_BSD: Tensor, y_ND: Tensor, slots_TK: Tensor, weights_TK: Tensor) -> Tensor:
        return h_BSD + pith_ops.moe_unpermute(y_ND, slots_TK, weights_TK).view_as(h_BSD)

    def reference_forward(self, h_BSD: Tensor, pos: Positions) -> Tensor:
        h_BSD = h_BSD + self.self_attn(self.input_layernorm(h_BSD, True), pos, True)
        return h_BSD + self.mlp.reference(self.post_attention_layernorm(h_BSD, True))


class Model(DecoderModel):
    def __init__(self, cfg: Config):
        super().__init__(cfg, lambda i: Layer(cfg, i))

    def positions(self, position_ids_BS: Tensor, cp_group: ProcessGroup | None = None) -> Positions:
        inv_freq_R, factor = rope_frequencies(self.cfg, position_ids_BS.device)
        return rotary_positions(position_ids_BS, inv_freq_R, cp_group, factor)


def init_weights(model: Model, seed: int, mesh: Mesh = SINGLE) -> None:
    init_normal(model, seed, model.cfg.initializer_range, zero=("bias", "b_gate_up", "b_down"), mesh=mesh)


# Ours <-> transformers' (same layouts).
_EXPERT_NAMES = {
    "experts.w_gate_up": "experts.gate_up_proj",
    "experts.b_gate_up": "experts.gate_up_proj_bias",
    "experts.w_down": "experts.down_proj",
    "experts.b_down": "experts.down_proj_bias",
}


def from_hf_state_dict(sd: dict[str, Tensor], cfg: Config, experts: range | None = None) -> dict[str, Tensor]:
    hf_to_ours = {hf: ours for ours, hf in _EXPERT_NAMES.items()}
    out = {}
    for k, v in sd.items():
        prefix, _, leaf = k.removeprefix("model.").partition(".mlp.")
        out[f"{prefix}.mlp.{hf_to_ours.get(leaf, leaf)}" if leaf else prefix] = v
    for i in range(cfg.num_hidden_layers):
        out[f"layers.{i}.mlp.expert_bias"] = torch.zeros(cfg.num_local_experts, dtype=torch.float32)
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


def to_hf_state_dict(sd: dict[str, Tensor], cfg: Config) -> dict[str, Tensor]:
    out = {}
    for k, v in sd.items():
        prefix, _, leaf = k.partition(".mlp.")
        if leaf == "expert_bias":
            if not v.is_meta and bool(v.any()):
                raise ValueError(f"{k} is nonzero: HF GPT-OSS has no selection-only bias to export it to")
        elif k == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                out[k] = v
        else:
            out["model." + (f"{prefix}.mlp.{_EXPERT_NAMES.get(leaf, leaf)}" if leaf else prefix)] = v
    return out


# Vocab 260: the byte tokenizer's; window shorter than the test sequences.
TINY = Config(
    vocab_size=260, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=5,
    yarn=Yarn(factor=4.0, original_max_position_embeddings=32), max_position_embeddings=128,
)  # fmt: skip
GPT_OSS_20B = Config(
    vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
    num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
)  # fmt: skip
