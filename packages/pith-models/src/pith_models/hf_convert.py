"""The Hugging Face conversion helpers that family files call: the config.json checks closing every
Config.from_hf, and the state-dict layout of fused SwiGLU MLPs and experts (Qwen3-MoE, DeepSeek-V2)."""

import math
from collections.abc import Iterable
from dataclasses import MISSING, fields

import torch
from torch import Tensor

# Fields no family's math reads: HF bookkeeping, generation, and loss knobs the trainer sets.
BOOKKEEPING = (
    "architectures", "transformers_version", "torch_dtype", "dtype", "use_cache", "bos_token_id",
    "eos_token_id", "pad_token_id", "output_router_logits", "router_aux_loss_coef",
)  # fmt: skip


def check_ranges(cfg, zero_ok: tuple[str, ...] = ()) -> None:
    """A family Config's ints are counts or sizes >= 1 (`zero_ok`'s >= 0), its floats finite and > 0."""
    for name, v in vars(cfg).items():
        least = int(name not in zero_ok)
        if isinstance(v, float) and not 0 < v < math.inf:
            raise ValueError(f"{name} must be finite and > 0, got {v}")
        if isinstance(v, int) and not isinstance(v, bool) and v < least:
            raise ValueError(f"{name} must be >= {least}, got {v}")


def hf_fields(d: dict, cls: type) -> dict:
    """A copy of config.json's `d` without its model_type, which must be cls's (or absent)."""
    d = dict(d)
    if (model_type := d.pop("model_type", cls.model_type)) != cls.model_type:
        raise ValueError(f"expected model_type {cls.model_type!r}, got {model_type!r}")
    return d


def config_kwargs_from_hf(d: dict, cls: type, fixed: dict, ignored: tuple[str, ...]) -> dict:
    """-> cls's keyword arguments, `ignored` and BOOKKEEPING dropped. ValueError: a `fixed` field
    holding another value, a field cls lacks, a required field absent."""
    d = {k: v for k, v in d.items() if k not in ignored + BOOKKEEPING}
    for key, allowed in fixed.items():
        if key in d and d.pop(key) != allowed:
            raise ValueError(f"config field {key}: only {allowed!r} is supported")
    if unknown := sorted(set(d) - {f.name for f in fields(cls)}):
        raise ValueError(f"unsupported {cls.model_type} config fields: {unknown}")
    if missing := [f.name for f in fields(cls) if f.default is MISSING and f.name not in d]:
        raise ValueError(f"{cls.model_type} config lacks required fields: {missing}")
    return d


def yarn_params_from_hf(d: dict, default_theta: float, yarn_cls: type) -> tuple[float, dict | None]:
    """Pop rope_parameters (transformers 5) or rope_scaling + rope_theta (4.x) -> (theta, the YaRN
    parameters; None for the default rope)."""
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
    if unknown := sorted(set(rope) - {f.name for f in fields(yarn_cls)}):
        raise ValueError(f"unsupported yarn rope parameters: {unknown}")
    return theta, rope


def from_hf_swiglu_state_dict(
    sd: dict[str, Tensor], moe_layers: Iterable[int], E: int, tie_word_embeddings: bool, experts: range | None
) -> dict[str, Tensor]:
    """HF names and layouts -> ours: gate_proj | up_proj [F, D] fuse into gate_up_proj [2F, D]; the
    per-expert [out, in] weights of `experts` (None: all E) stack into w_gate_up [E_held, D, 2F] and
    w_down [E_held, F, D]; each MoE layer gets a zero expert_bias [E]."""
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
        held = [f"{hf}{e}." for e in (range(E) if experts is None else experts)]
        gate_up = [torch.cat((sd[x + "gate_proj.weight"].T, sd[x + "up_proj.weight"].T), dim=1) for x in held]
        down = [sd[x + "down_proj.weight"].T for x in held]
        for name, t in (("w_gate_up", gate_up), ("w_down", down)):  # an empty FSDP piece: empty
            out[f"{ours}experts.{name}"] = torch.stack(t) if t else torch.empty(0, 0, 0, dtype=v.dtype)
        out[ours + "expert_bias"] = torch.zeros(E, dtype=torch.float32)
    if tie_word_embeddings:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


def to_hf_swiglu_state_dict(sd: dict[str, Tensor], tie_word_embeddings: bool, hf_name: str) -> dict:
    """The inverse of from_hf_swiglu_state_dict; a nonzero expert_bias is a ValueError."""
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
            mlp = "model." + prefix.removesuffix("gate_up_proj.")
            out[mlp + "gate_proj.weight"], out[mlp + "up_proj.weight"] = v.chunk(2)
        elif k == "lm_head.weight":
            if not tie_word_embeddings:
                out[k] = v
        else:
            out["model." + k] = v
    return out
