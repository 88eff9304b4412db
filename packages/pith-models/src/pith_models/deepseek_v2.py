"""DeepSeek-V2 and DeepSeek-V2-Lite in the five-stage layer form.

Architectural choices (those of transformers' DeepseekV2 and of DeepSeek's original code):
- pre-norm decoder: h += attn(rms_norm(h)); h += mlp(rms_norm(h)); final rms_norm, then lm_head;
  no biases anywhere;
- multi-head latent attention (MLA): queries from q_proj, or with a query LoRA (q_lora_rank set)
  from q_b_proj(rms_norm(q_a_proj(x))); keys and values from a compressed latent: kv_a_proj_with_mqa
  maps x to kv_lora_rank latent dims plus qk_rope_head_dim rotary dims shared by every head, and
  kv_b_proj expands rms_norm(latent) to each head's key "nope" part and value. The q/k head dim is
  nope + rope and differs from v_head_dim. The two LoRA norms use eps 1e-6 whatever rms_norm_eps
  says, as upstream builds them;
- decoupled RoPE: only the rope part of q and k is rotated, on interleaved pairs (2i, 2i+1) (the
  complex-number form of the upstream code: pith_ops.apply_rope(interleaved=True));
- YaRN rope scaling or none: inverse frequencies blended between interpolation and extrapolation,
  cos and sin multiplied by the YaRN attention factor, and the softmax scale qk_head_dim**-0.5
  multiplied by mscale(factor, mscale_all_dim)**2 when mscale_all_dim is set;
- layer i is MoE when i >= first_k_dense_replace and i % moe_layer_freq == 0, else a dense SwiGLU
  MLP of width intermediate_size (DeepSeek's rule; transformers 5 ignores moe_layer_freq, and every
  released checkpoint has it 1);
- MoE: router logits in fp32, softmax over the routed experts, top-k "greedy", or
  "group_limited_greedy" (experts in n_group groups, a group ranked by its best expert, only the
  topk_group best groups eligible); the aux-loss-free `expert_bias` is added to the scores for the
  selection only. Combine weights: the chosen probabilities times routed_scaling_factor, or, with
  norm_topk_prob and top-k > 1, the chosen probabilities renormalised to sum 1 and not scaled
  (DeepSeek's code; transformers 5 ignores norm_topk_prob, every released checkpoint has it false);
- shared experts: one SwiGLU MLP of width n_shared_experts * moe_intermediate_size, in stage 1.

Shape legend: B batch, S sequence, T = B*S tokens, D hidden, H heads, C q/k head dim (nope + rope),
N nope dims, P rope dims, R = P/2 rotary pairs, A v head dim, L kv_lora_rank, E experts (E_held:
those this module holds), G expert groups, F expert width, K top-k, V vocabulary.
"""

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import ClassVar

import pith_ops
import torch
from pith_engine.attention import attention, attention_reference
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

from pith_models.hf_config import config_kwargs_from_hf, yarn_params_from_hf

LORA_NORM_EPS = 1e-6  # upstream builds q_a_layernorm / kv_a_layernorm with the default eps


@dataclass(frozen=True)
class Yarn:
    """YaRN rope scaling, named as in the Hugging Face rope parameters."""

    factor: float  # context extension factor
    original_max_position_embeddings: int  # pretraining context length
    beta_fast: float = 32.0  # rotations bounding the extrapolated (high-frequency) band
    beta_slow: float = 1.0  # rotations bounding the interpolated (low-frequency) band
    mscale: float | None = None  # cos/sin factor numerator: mscale(factor, mscale) / mscale(factor, all)
    mscale_all_dim: float | None = None  # its denominator; also the softmax-scale correction
    attention_factor: float | None = None  # explicit cos/sin factor, overriding the mscales
    truncate: bool = True  # round the blend range to whole dims


@dataclass(frozen=True)
class Config:
    model_type: ClassVar[str] = "deepseek_v2"  # the Hugging Face model_type (key of pith_models.hf.MODULES)

    vocab_size: int  # V
    hidden_size: int  # D
    intermediate_size: int  # width of the dense SwiGLU layers
    moe_intermediate_size: int  # F, width of one routed (and of one shared) expert
    num_hidden_layers: int  # decoder layers
    num_attention_heads: int  # H
    q_lora_rank: int | None  # rank of the query LoRA; None: a plain q_proj (V2-Lite)
    kv_lora_rank: int  # L, width of the compressed key/value latent
    qk_nope_head_dim: int  # N, q/k dims per head without rotary embedding
    qk_rope_head_dim: int  # P, q/k dims per head with rotary embedding (k's shared by the heads)
    v_head_dim: int  # A, value dims per head
    n_routed_experts: int  # E
    n_shared_experts: int  # shared experts, run as one MLP of width n_shared_experts * F
    num_experts_per_tok: int  # K
    first_k_dense_replace: int = 0  # the first layers are dense ...
    moe_layer_freq: int = 1  # ... and the others are MoE when their index is a multiple of this
    topk_method: str = "greedy"  # "greedy" or "group_limited_greedy"
    n_group: int | None = None  # G, expert groups of group_limited_greedy
    topk_group: int | None = None  # groups a token may route into under group_limited_greedy
    norm_topk_prob: bool = False  # renormalise the chosen probabilities (then no routed scaling)
    routed_scaling_factor: float = 1.0  # multiplies the combine weights when not renormalised
    rms_norm_eps: float = 1e-6  # eps of the block and final RMSNorms
    rope_theta: float = 10_000.0  # RoPE base
    yarn: Yarn | None = None  # YaRN rope scaling; None: plain RoPE
    tie_word_embeddings: bool = False  # lm_head.weight is embed_tokens.weight
    max_position_embeddings: int = 2048  # context length (only YaRN's default factor reads it; HF default)
    initializer_range: float = 0.02  # std of init_weights' normal draws

    @property
    def qk_head_dim(self) -> int:  # C
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def __post_init__(self):
        if self.topk_method not in ("greedy", "group_limited_greedy"):
            raise ValueError(
                f"topk_method must be 'greedy' or 'group_limited_greedy', got {self.topk_method!r}"
            )
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")
        if self.moe_layer_freq < 1:
            raise ValueError(f"moe_layer_freq must be >= 1, got {self.moe_layer_freq}")
        E, K = self.n_routed_experts, self.num_experts_per_tok
        if not 1 <= K <= E:
            raise ValueError(f"num_experts_per_tok must be in [1, n_routed_experts={E}], got {K}")
        if self.topk_method == "group_limited_greedy":
            G, TG = self.n_group, self.topk_group
            if G is None or TG is None or E % G or not 1 <= TG <= G or K > TG * (E // G):
                raise ValueError(
                    "group_limited_greedy needs n_group dividing n_routed_experts, "
                    "1 <= topk_group <= n_group and num_experts_per_tok <= topk_group * "
                    "(n_routed_experts / n_group); got "
                    f"n_routed_experts={E}, n_group={G}, topk_group={TG}, num_experts_per_tok={K}"
                )

    def is_moe(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @classmethod
    def from_hf(cls, d: dict) -> "Config":
        """From a Hugging Face config.json dict (transformers 4.x or 5.x spelling, or DeepSeek's own)."""
        d = dict(d)
        model_type = d.pop("model_type", cls.model_type)
        if model_type != cls.model_type:
            raise ValueError(f"expected model_type {cls.model_type!r}, got {model_type!r}")
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
            "model_type": self.model_type,
            "architectures": ["DeepseekV2ForCausalLM"],
            **d,
            **_FIXED,
            "num_key_value_heads": self.num_attention_heads,
            "rope_parameters": rope,
        }


# Fields whose other values would change the math and are not implemented: the value we support.
_FIXED = {
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
    "scoring_func": "softmax",
}  # fmt: skip
# Fields that do not change the forward math (generation, HF bookkeeping, derived head dims, loss and
# parallelism knobs of DeepSeek's code that the trainer and engine own here).
_IGNORED = (
    "architectures", "transformers_version", "torch_dtype", "dtype", "use_cache", "bos_token_id",
    "eos_token_id", "pad_token_id", "output_router_logits", "router_aux_loss_coef", "aux_loss_alpha",
    "seq_aux", "ep_size", "pretraining_tp", "auto_map", "_name_or_path", "head_dim", "qk_head_dim",
)  # fmt: skip


def _rope_from_hf(d: dict) -> tuple[float, Yarn | None]:
    """Pop rope_parameters (transformers 5) or rope_scaling + rope_theta (4.x, DeepSeek) -> (theta, yarn)."""
    theta, rope = yarn_params_from_hf(d, 10_000.0, Yarn)
    if rope is None:
        return theta, None
    rope.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
    if rope.get("factor") is None:  # transformers' rule: the context extension actually configured
        rope["factor"] = d["max_position_embeddings"] / rope["original_max_position_embeddings"]
    return theta, Yarn(**{k: v for k, v in rope.items() if v is not None})


def rope_frequencies(cfg: Config, device: torch.device) -> tuple[Tensor, float]:
    """-> (inverse frequencies [R] fp64, factor multiplying cos and sin), YaRN applied when set."""
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
    """Multi-head latent attention."""

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
        if reference:
            p = pos.position_ids_BS
            o_BSHA = attention_reference(q_BSHC, k_BSHC, v_BSHA, p, p, scale=self.scale)[0]
        else:
            o_BSHA = attention(q_BSHC, k_BSHC, v_BSHA, pos, scale=self.scale)
        return self.o_proj(o_BSHA.reshape(B, S, H * A))


# MLP, Experts and the HF conversion are qwen3_moe's too, deliberately: each family owns its own.
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


class MoE(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        D, E, F = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        self.cfg = cfg
        self.gate = Router(D, E, bias=False)
        self.experts = Experts(E, D, F)
        self.shared_experts = MLP(D, cfg.n_shared_experts * F)
        # Aux-loss-free balancing: added to the scores for top-k selection only; the trainer updates it.
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
        """Shared experts, routing, then each routed expert over its tokens in a loop (fp32 sum)."""
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
    def __init__(self, cfg: Config, layer_ids: Iterable[int] | None = None):
        super().__init__(cfg, lambda i: Layer(cfg, i), layer_ids)

    def positions(self, position_ids_BS: Tensor, cp_group: ProcessGroup | None = None) -> Positions:
        inv_freq_R, factor = rope_frequencies(self.cfg, position_ids_BS.device)
        return rotary_positions(position_ids_BS, inv_freq_R, cp_group, factor)


def init_weights(model: Model, seed: int, mesh: Mesh = SINGLE) -> None:
    """Norm weights 1, expert_bias 0, every other weight N(0, initializer_range), reproducible from seed
    and the same global weights under any layout (`mesh`: the one model was sharded over)."""
    init_normal(model, seed, model.cfg.initializer_range, mesh=mesh)


def from_hf_state_dict(sd: dict[str, Tensor], cfg: Config, experts: range | None = None) -> dict[str, Tensor]:
    """Hugging Face names and layouts -> ours: every gate_proj / up_proj pair [F, D] fuses into
    gate_up_proj [2F, D]; the per-expert [out, in] weights of layers.{i}.mlp.experts.{e}, e in
    `experts` (default all), stack into w_gate_up [len(experts), D, 2F] and w_down [len(experts), F, D];
    each MoE layer gets a zero expert_bias [E]. Assumes a complete input (hf.py checks it first)."""
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
    held = range(cfg.n_routed_experts) if experts is None else experts
    for i in filter(cfg.is_moe, range(cfg.num_hidden_layers)):
        hf, ours = f"model.layers.{i}.mlp.experts.", f"layers.{i}.mlp."
        per_expert = [f"{hf}{e}." for e in held]
        out[ours + "experts.w_gate_up"] = torch.stack(
            [torch.cat((sd[x + "gate_proj.weight"].T, sd[x + "up_proj.weight"].T), dim=1) for x in per_expert]
        )
        out[ours + "experts.w_down"] = torch.stack([sd[x + "down_proj.weight"].T for x in per_expert])
        out[ours + "expert_bias"] = torch.zeros(cfg.n_routed_experts, dtype=torch.float32)
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


def to_hf_state_dict(sd: dict[str, Tensor], cfg: Config) -> dict[str, Tensor]:
    """The inverse of from_hf_state_dict. A nonzero expert_bias is a ValueError: HF DeepSeek-V2 has no
    selection-only bias to export it to."""
    out = {}
    for k, v in sd.items():
        prefix = k.rpartition(".")[0] + "."
        if k.endswith("expert_bias"):
            if not v.is_meta and bool(v.any()):
                raise ValueError(f"{k} is nonzero: HF DeepSeek-V2 has no routing bias to export it to")
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
            if not cfg.tie_word_embeddings:
                out[k] = v
        else:
            out["model." + k] = v
    return out


# For tests (and the trainer: vocab 260 fits its byte tokenizer): a dense layer then two MoE layers;
# query LoRA, group-limited routing and YaRN are on here, and the tests switch them off one by one.
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
