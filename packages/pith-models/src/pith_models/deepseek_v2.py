"""DeepSeek-V2 and DeepSeek-V2-Lite in the five-stage layer form.

Architectural choices (transformers' DeepseekV2 and DeepSeek's original code):
- pre-norm decoder, final rms_norm, then lm_head; no biases anywhere;
- multi-head latent attention (MLA): queries from q_proj, or q_b_proj(rms_norm(q_a_proj(x))) with a
  query LoRA; kv_a_proj_with_mqa maps x to a latent plus rotary dims shared by every head, and
  kv_b_proj expands rms_norm(latent) to each head's key "nope" part and value. The two LoRA norms use
  eps 1e-6 whatever rms_norm_eps says, as upstream's;
- decoupled RoPE on the rope part of q and k only, interleaved pairs (2i, 2i+1);
- YaRN or plain RoPE; with YaRN cos and sin carry its attention factor, and the softmax scale is
  multiplied by mscale(factor, mscale_all_dim)**2 when mscale_all_dim is set;
- layer i is MoE when i >= first_k_dense_replace and i % moe_layer_freq == 0, else a dense SwiGLU
  MLP (DeepSeek's rule; transformers 5 ignores moe_layer_freq, every release has it 1);
- MoE: fp32 router logits, softmax, top-k "greedy" or "group_limited_greedy", `expert_bias` added
  for the selection only. Combine weights: the chosen probabilities times routed_scaling_factor, or
  with norm_topk_prob and top-k > 1 renormalised and not scaled (DeepSeek's code; transformers 5
  ignores it, every release has it false);
- shared experts: one SwiGLU MLP, in stage 1.

Shape legend: B batch, S sequence, T = B*S tokens, D hidden, H heads, C q/k head dim (nope + rope),
N nope dims, P rope dims, R = P/2 rotary pairs, A v head dim, L kv_lora_rank, E experts (E_held:
those this module holds), G expert groups, F expert width, K top-k, V vocabulary.
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

from pith_models.hf_convert import (
    check_ranges,
    config_kwargs_from_hf,
    from_hf_swiglu_state_dict,
    hf_fields,
    to_hf_swiglu_state_dict,
    yarn_params_from_hf,
)

LORA_NORM_EPS = 1e-6


@dataclass(frozen=True)
class Yarn:
    """YaRN rope scaling, named as in the Hugging Face rope parameters."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None  # cos/sin factor: mscale(factor, mscale) / mscale(factor, all)
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # explicit cos/sin factor, overriding the mscales
    truncate: bool = True


@dataclass(frozen=True)
class Config:
    model_type: ClassVar[str] = "deepseek_v2"  # pith_models.hf.MODULES

    vocab_size: int  # V
    hidden_size: int  # D
    intermediate_size: int  # dense layers' width
    moe_intermediate_size: int  # F, of a routed (and of a shared) expert
    num_hidden_layers: int
    num_attention_heads: int  # H
    q_lora_rank: int | None  # None: a plain q_proj (V2-Lite)
    kv_lora_rank: int  # L
    qk_nope_head_dim: int  # N
    qk_rope_head_dim: int  # P (k's shared by the heads)
    v_head_dim: int  # A
    n_routed_experts: int  # E
    n_shared_experts: int  # run as one MLP of width n_shared_experts * F
    num_experts_per_tok: int  # K
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    topk_method: str = "greedy"  # or "group_limited_greedy"
    n_group: int | None = None  # G
    topk_group: int | None = None
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    yarn: Yarn | None = None  # None: plain RoPE
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048  # only YaRN's default factor reads it (HF default)
    initializer_range: float = 0.02

    @property
    def qk_head_dim(self) -> int:  # C
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def __post_init__(self):
        check_ranges(self, ("first_k_dense_replace",))
        if self.topk_method not in ("greedy", "group_limited_greedy"):
            raise ValueError(
                f"topk_method must be 'greedy' or 'group_limited_greedy', got {self.topk_method!r}"
            )
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")
        E, K = self.n_routed_experts, self.num_experts_per_tok
        if not 1 <= K <= E:
            raise ValueError(f"num_experts_per_tok must be in [1, n_routed_experts={E}], got {K}")
        if self.topk_method == "group_limited_greedy":
            G, TG = self.n_group, self.topk_group
            if G is None or TG is None or E % G or not 1 <= TG <= G or K > TG * (E // G):
                raise ValueError(
                    "group_limited_greedy needs n_group dividing n_routed_experts, 1 <= topk_group <= n_group"
                    " and num_experts_per_tok <= topk_group * (n_routed_experts / n_group); got"
                    f" n_routed_experts={E}, n_group={G}, topk_group={TG}, num_experts_per_tok={K}"
                )

    def is_moe(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @classmethod
    def from_hf(cls, d: dict) -> "Config":
        """transformers 4.x or 5.x spelling, or DeepSeek's own."""
        d = hf_fields(d, cls)
        heads, kv_heads = d["num_attention_heads"], d.pop("num_key_value_heads", None)
        if kv_heads not in (None, heads):
            raise ValueError(
                f"config field num_key_value_heads: MLA expands keys for every head, so it must equal "
                f"num_attention_heads ({heads}), got {kv_heads}"
            )
        d["rope_theta"], d["yarn"] = _rope_from_hf(d)
        return cls(**config_kwargs_from_hf(d, cls, _FIXED, _IGNORED))

    def to_hf(self) -> dict:
        d = asdict(self)
        yarn = d.pop("yarn")
        rope = {"rope_type": "default", "rope_theta": d.pop("rope_theta")}
        if yarn is not None:
            rope = {**rope, "rope_type": "yarn", **{k: v for k, v in yarn.items() if v is not None}}
        return {
            "model_type": self.model_type, "architectures": ["DeepseekV2ForCausalLM"], **d, **_FIXED,
            "num_key_value_heads": self.num_attention_heads, "rope_parameters": rope,
        }  # fmt: skip


# Fields whose other values would change the math (not implemented).
_FIXED = {
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
    "scoring_func": "softmax",
}  # fmt: skip
# Beyond hf_convert.BOOKKEEPING: derived head dims, DeepSeek's loss and parallelism knobs.
_IGNORED = (
    "aux_loss_alpha", "seq_aux", "ep_size", "pretraining_tp", "auto_map", "_name_or_path", "head_dim",
    "qk_head_dim",
)  # fmt: skip


def _rope_from_hf(d: dict) -> tuple[float, Yarn | None]:
    """Pops the rope fields -> (theta, yarn)."""
    theta, rope = yarn_params_from_hf(d, 10_000.0, Yarn)
    if rope is None:
        return theta, None
    rope.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
    if rope.get("factor") is None:  # transformers' rule: the context extension actually configured
        rope["factor"] = d["max_position_embeddings"] / rope["original_max_position_embeddings"]
    return theta, Yarn(**{k: v for k, v in rope.items() if v is not None})


def rope_frequencies(cfg: Config, device: torch.device) -> tuple[Tensor, float]:
    """-> (inverse frequencies [R] fp64, factor multiplying cos and sin)."""
    y = cfg.yarn
    inv_freq_R = rope_inv_freq(cfg.rope_theta, cfg.qk_rope_head_dim, device, y)
    if y is None:
        return inv_freq_R, 1.0
    if y.attention_factor is not None:
        return inv_freq_R, y.attention_factor
    if y.mscale and y.mscale_all_dim:
        return inv_freq_R, yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim)
    return inv_freq_R, yarn_mscale(y.factor)


def softmax_scale(cfg: Config) -> float:
    scale = cfg.qk_head_dim**-0.5
    if cfg.yarn is not None and cfg.yarn.mscale_all_dim:
        scale *= yarn_mscale(cfg.yarn.factor, cfg.yarn.mscale_all_dim) ** 2
    return scale


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        D, H, C, L = cfg.hidden_size, cfg.num_attention_heads, cfg.qk_head_dim, cfg.kv_lora_rank
        P = cfg.qk_rope_head_dim
        self.cfg = cfg
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(D, H * C, bias=False)
        else:
            self.q_a_proj = Linear(D, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = Linear(cfg.q_lora_rank, H * C, bias=False)
        self.kv_a_proj_with_mqa = Linear(D, L + P, bias=False)
        self.kv_a_layernorm = RMSNorm(L, LORA_NORM_EPS)
        self.kv_b_proj = Linear(L, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = Linear(H * cfg.v_head_dim, D, bias=False)
        self.scale = softmax_scale(cfg)

    def forward(self, x_BSD: Tensor, pos: Positions, reference: bool = False) -> Tensor:
        cfg, (B, S, _) = self.cfg, x_BSD.shape
        H, N, P, A = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        L = cfg.kv_lora_rank
        rope = pith_ops.apply_rope_reference if reference else pith_ops.apply_rope
        if cfg.q_lora_rank is None:
            q = self.q_proj(x_BSD)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BSD), reference))
        q_nope_BSHN, q_rope_BSHP = q.view(B, S, H, N + P).split([N, P], dim=-1)
        latent_BSL, k_rope_BSP = self.kv_a_proj_with_mqa(x_BSD).split([L, P], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent_BSL, reference))
        k_nope_BSHN, v_BSHA = kv.view(B, S, H, N + A).split([N, A], dim=-1)
        q_rope_BSHP = rope(q_rope_BSHP, pos.cos_BSR, pos.sin_BSR, interleaved=True)
        k_rope_BS1P = rope(k_rope_BSP[:, :, None], pos.cos_BSR, pos.sin_BSR, interleaved=True)
        q_BSHC = torch.cat((q_nope_BSHN, q_rope_BSHP), dim=-1)
        k_BSHC = torch.cat((k_nope_BSHN, k_rope_BS1P.expand(B, S, H, P)), dim=-1)
        o_BSHA = attention(q_BSHC, k_BSHC, v_BSHA, pos, scale=self.scale, reference=reference)
        return self.o_proj(o_BSHA.reshape(B, S, H * A))


# MLP and Experts are qwen3_moe's too, deliberately: each family is self-contained.
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
        D, E, F = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        self.cfg = cfg
        self.gate = Router(D, E, bias=False)
        self.experts = Experts(E, D, F)
        self.shared_experts = MLP(D, cfg.n_shared_experts * F)
        self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32))

    def route(self, x_TD: Tensor) -> Routing:
        cfg = self.cfg
        logits_TE = self.gate(x_TD)
        probs_TE = logits_TE.softmax(-1)
        select_TE = probs_TE.detach() + self.expert_bias
        if cfg.topk_method == "group_limited_greedy":
            select_TGX = select_TE.unflatten(-1, (cfg.n_group, -1))
            groups_TG = select_TGX.amax(-1).topk(cfg.topk_group, dim=-1).indices
            keep_TG = torch.zeros_like(select_TGX[..., 0], dtype=torch.bool).scatter_(1, groups_TG, True)
            select_TE = select_TGX.masked_fill(~keep_TG[..., None], float("-inf")).flatten(1)
        expert_ids_TK = select_TE.topk(cfg.num_experts_per_tok, dim=-1).indices
        weights_TK = probs_TE.gather(1, expert_ids_TK)
        if cfg.norm_topk_prob and cfg.num_experts_per_tok > 1:
            weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + 1e-20)
        else:
            weights_TK = weights_TK * cfg.routed_scaling_factor
        return Routing(x_TD, expert_ids_TK, weights_TK, probs_TE, logits_TE)

    def reference(self, x_BSD: Tensor) -> Tensor:
        r = self.route(x_BSD.flatten(0, 1))
        routed_TD = self.experts.reference(r.x_TD, r.expert_ids_TK, r.weights_TK)
        return self.shared_experts(x_BSD, True) + routed_TD.view_as(x_BSD)


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
        return Stage1Out(h_BSD + self.mlp.shared_experts(x_BSD), self.mlp.route(x_BSD.flatten(0, 1)))

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
        inv_freq_R, factor = rope_frequencies(self.cfg, position_ids_BS.device)
        return rotary_positions(position_ids_BS, inv_freq_R, cp_group, factor)


def init_weights(model: Model, seed: int, mesh: Mesh = SINGLE) -> None:
    init_normal(model, seed, model.cfg.initializer_range, mesh=mesh)


def from_hf_state_dict(sd: dict[str, Tensor], cfg: Config, experts: range | None = None) -> dict[str, Tensor]:
    moe_layers = filter(cfg.is_moe, range(cfg.num_hidden_layers))
    return from_hf_swiglu_state_dict(sd, moe_layers, cfg.n_routed_experts, cfg.tie_word_embeddings, experts)


def to_hf_state_dict(sd: dict[str, Tensor], cfg: Config) -> dict[str, Tensor]:
    return to_hf_swiglu_state_dict(sd, cfg.tie_word_embeddings, "DeepSeek-V2")


# For tests (vocab 260: the trainer's byte tokenizer); its query LoRA, group-limited routing and YaRN
# the tests switch off one by one.
TINY = Config(
    vocab_size=260, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=12, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3, first_k_dense_replace=1,
    topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
    yarn=Yarn(factor=4.0, original_max_position_embeddings=32, mscale=0.9, mscale_all_dim=0.7),
    max_position_embeddings=128,
)  # fmt: skip
DEEPSEEK_V2_LITE = Config(
    vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
    num_hidden_layers=27, num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
    first_k_dense_replace=1, rope_theta=10_000.0, max_position_embeddings=163840,
    yarn=Yarn(factor=40.0, original_max_position_embeddings=4096, mscale=0.707, mscale_all_dim=0.707),
)  # fmt: skip
