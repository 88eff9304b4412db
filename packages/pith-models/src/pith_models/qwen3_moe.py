"""Qwen3-MoE (Qwen/Qwen3-30B-A3B and its small relatives) in the five-stage layer form.

Architectural choices:
- pre-norm decoder, final rms_norm, then lm_head;
- grouped-query attention, head_dim independent of hidden_size / heads, no biases, per-head RMSNorm
  on q and k before RoPE; no sliding window;
- RoPE over the whole head dim, half-split pairs (i, i + head_dim/2), no scaling;
- MoE layers: fp32 router logits, softmax over all experts, top-k (selection adds the aux-loss-free
  `expert_bias`), combine weights the selected probabilities, renormalised when norm_topk_prob;
  SwiGLU experts; no shared expert;
- dense SwiGLU layers where layer i is in mlp_only_layers or (i + 1) % decoder_sparse_step != 0.

Shape legend: B batch, S sequence, T = B*S tokens, D hidden, H query heads, G key/value heads,
Dh head dim, R = Dh/2 rotary pairs, E experts (E_held: those this module holds), F expert width,
K top-k, N rows grouped by expert, V vocabulary.
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
)
from pith_engine.parallel import SINGLE, Mesh
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from pith_models.hf_convert import (
    check_ranges,
    config_kwargs_from_hf,
    from_hf_swiglu_state_dict,
    hf_fields,
    to_hf_swiglu_state_dict,
)


@dataclass(frozen=True)
class Config:
    model_type: ClassVar[str] = "qwen3_moe"  # pith_models.hf.MODULES

    vocab_size: int  # V
    hidden_size: int  # D
    intermediate_size: int  # dense layers' width
    moe_intermediate_size: int  # F
    num_hidden_layers: int
    num_attention_heads: int  # H
    num_key_value_heads: int  # G
    head_dim: int  # Dh
    num_experts: int  # E
    num_experts_per_tok: int  # K
    norm_topk_prob: bool
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960  # no effect on the math
    initializer_range: float = 0.02

    def __post_init__(self):
        check_ranges(self)
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        H, G = self.num_attention_heads, self.num_key_value_heads
        E, K = self.num_experts, self.num_experts_per_tok
        if H % G:
            raise ValueError(f"num_attention_heads ({H}) must be a multiple of num_key_value_heads ({G})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not 1 <= K <= E:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={E}], got {K}")
        if bad := [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]:
            raise ValueError(f"mlp_only_layers {bad} are outside [0, {self.num_hidden_layers})")

    def is_moe(self, i: int) -> bool:
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_hf(cls, d: dict) -> "Config":
        """transformers 4.x or 5.x spelling."""
        d = hf_fields(d, cls)
        # transformers 5 writes num_local_experts and rope_parameters; 4.x num_experts and rope_theta.
        if "num_local_experts" in d:
            d["num_experts"] = d.pop("num_local_experts")
        for key in ("rope_parameters", "rope_scaling"):
            rope = d.pop(key, None) or {}
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type != "default":
                raise ValueError(f"{key}: rope type {rope_type!r} is not supported (only 'default')")
            if "rope_theta" in rope:
                d["rope_theta"] = rope["rope_theta"]
        if d.pop("use_sliding_window", False):
            raise ValueError("config field use_sliding_window: only False is supported")
        d.pop("sliding_window", None)  # HF ignores it then
        d.pop("max_window_layers", None)
        if "head_dim" not in d and {"hidden_size", "num_attention_heads"} <= set(d):
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]  # transformers' default
        return cls(**config_kwargs_from_hf(d, cls, _FIXED, ()))

    def to_hf(self) -> dict:
        d = asdict(self)
        d["mlp_only_layers"] = list(self.mlp_only_layers)
        rope = {"rope_type": "default", "rope_theta": d.pop("rope_theta")}
        return {
            "model_type": self.model_type, "architectures": ["Qwen3MoeForCausalLM"], **d, **_FIXED,
            "rope_parameters": rope, "use_sliding_window": False,
        }  # fmt: skip


# Fields whose other values would change the math (not implemented).
_FIXED = {"hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0}


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        D, H, G, Dh = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.H, self.G, self.Dh = H, G, Dh
        self.q_proj = Linear(D, H * Dh, bias=False)
        self.k_proj = Linear(D, G * Dh, bias=False)
        self.v_proj = Linear(D, G * Dh, bias=False)
        self.o_proj = Linear(H * Dh, D, bias=False)
        self.q_norm = RMSNorm(Dh, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(Dh, cfg.rms_norm_eps)

    def forward(self, x_BSD: Tensor, pos: Positions, reference: bool = False) -> Tensor:
        B, S, _ = x_BSD.shape
        rope = pith_ops.apply_rope_reference if reference else pith_ops.apply_rope
        q_BSHD = self.q_norm(self.q_proj(x_BSD).view(B, S, self.H, self.Dh), reference)
        k_BSGD = self.k_norm(self.k_proj(x_BSD).view(B, S, self.G, self.Dh), reference)
        v_BSGD = self.v_proj(x_BSD).view(B, S, self.G, self.Dh)
        q_BSHD = rope(q_BSHD, pos.cos_BSR, pos.sin_BSR)
        k_BSGD = rope(k_BSGD, pos.cos_BSR, pos.sin_BSR)
        o_BSHD = attention(q_BSHD, k_BSGD, v_BSGD, pos, scale=self.Dh**-0.5, reference=reference)
        return self.o_proj(o_BSHD.reshape(B, S, self.H * self.Dh))


# MLP and Experts are deepseek_v2's too, deliberately: each family is self-contained.
class MLP(nn.Module):
    def __init__(self, D: int, F: int):
        super().__init__()
        self.gate_up_proj = Linear(D, 2 * F, bias=False)
        self.down_proj = Linear(F, D, bias=False)

    def forward(self, x: Tensor, reference: bool = False) -> Tensor:
        swiglu = pith_ops.swiglu_reference if reference else pith_ops.swiglu
        return self.down_proj(swiglu(self.gate_up_proj(x)))


class Experts(FP8Switch, nn.Module):
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


class MoE(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        D, E, F = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Router(D, E, bias=False)
        self.experts = Experts(E, D, F)
        self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32))

    def route(self, x_TD: Tensor) -> Routing:
        logits_TE = self.gate(x_TD)
        probs_TE = logits_TE.softmax(-1)
        expert_ids_TK = torch.topk(probs_TE.detach() + self.expert_bias, self.top_k, dim=-1).indices
        weights_TK = probs_TE.gather(1, expert_ids_TK)
        if self.norm_topk_prob:
            weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
        return Routing(x_TD, expert_ids_TK, weights_TK, probs_TE, logits_TE)

    def reference(self, x_BSD: Tensor) -> Tensor:
        r = self.route(x_BSD.flatten(0, 1))
        return self.experts.reference(r.x_TD, r.expert_ids_TK, r.weights_TK).view_as(x_BSD)


class Layer(nn.Module):
    def __init__(self, cfg: Config, i: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe(i) else MLP(cfg.hidden_size, cfg.intermediate_size)

    @property
    def experts(self) -> Experts | None:
        return self.mlp.experts if isinstance(self.mlp, MoE) else None

    @property
    def router(self) -> Router | None:
        return self.mlp.gate if isinstance(self.mlp, MoE) else None

    def stage1(self, h_BSD: Tensor, pos: Positions) -> Stage1Out:
        h_BSD = h_BSD + self.self_attn(self.input_layernorm(h_BSD), pos)
        x_BSD = self.post_attention_layernorm(h_BSD)
        if isinstance(self.mlp, MLP):
            return Stage1Out(h_BSD + self.mlp(x_BSD), None)
        return Stage1Out(h_BSD, self.mlp.route(x_BSD.flatten(0, 1)))

    def stage3(self, x_ND: Tensor, group_ends_E: Tensor) -> Tensor:
        return self.mlp.experts(x_ND, group_ends_E)

    def stage5(self, h_BSD: Tensor, y_ND: Tensor, slots_TK: Tensor, weights_TK: Tensor) -> Tensor:
        return h_BSD + pith_ops.moe_unpermute(y_ND, slots_TK, weights_TK).view_as(h_BSD)

    def reference_forward(self, h_BSD: Tensor, pos: Positions) -> Tensor:
        h_BSD = h_BSD + self.self_attn(self.input_layernorm(h_BSD, True), pos, True)
        x_BSD = self.post_attention_layernorm(h_BSD, True)
        mlp_BSD = self.mlp(x_BSD, True) if isinstance(self.mlp, MLP) else self.mlp.reference(x_BSD)
        return h_BSD + mlp_BSD


class Model(DecoderModel):
    def __init__(self, cfg: Config):
        super().__init__(cfg, lambda i: Layer(cfg, i))

    def positions(self, position_ids_BS: Tensor, cp_group: ProcessGroup | None = None) -> Positions:
        inv_freq_R = rope_inv_freq(self.cfg.rope_theta, self.cfg.head_dim, position_ids_BS.device)
        return rotary_positions(position_ids_BS, inv_freq_R, cp_group)


def init_weights(model: Model, seed: int, mesh: Mesh = SINGLE) -> None:
    init_normal(model, seed, model.cfg.initializer_range, mesh=mesh)


def from_hf_state_dict(sd: dict[str, Tensor], cfg: Config, experts: range | None = None) -> dict[str, Tensor]:
    moe_layers = filter(cfg.is_moe, range(cfg.num_hidden_layers))
    return from_hf_swiglu_state_dict(sd, moe_layers, cfg.num_experts, cfg.tie_word_embeddings, experts)


def to_hf_state_dict(sd: dict[str, Tensor], cfg: Config) -> dict[str, Tensor]:
    return to_hf_swiglu_state_dict(sd, cfg.tie_word_embeddings, "Qwen3-MoE")


# For tests: a dense layer (mlp_only_layers), then a MoE layer; tests also vary decoder_sparse_step.
TINY = Config(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
    norm_topk_prob=True, mlp_only_layers=(0,), rope_theta=10_000.0, max_position_embeddings=512,
)  # fmt: skip
# The trainer's default: ~4M parameters, byte-level vocabulary (256 bytes + 4 special tokens).
TINY_MOE = Config(
    vocab_size=260, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
    norm_topk_prob=True, rope_theta=10_000.0, max_position_embeddings=2048,
)  # fmt: skip
QWEN3_30B_A3B = Config(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, rope_theta=1_000_000.0, max_position_embeddings=40960,
)  # fmt: skip
