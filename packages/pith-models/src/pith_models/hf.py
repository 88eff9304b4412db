"""Hugging Face interop: a directory of config.json + *.safetensors <-> a pith model.

Model-module convention (qwen3_moe.py, deepseek_v2.py and gpt_oss.py all follow it; this file relies
on it and on nothing else of theirs):
- a module docstring listing the architectural choices;
- `@dataclass(frozen=True) class Config` with a comment per field, a field `tie_word_embeddings`,
  validation in __post_init__, `Config.from_hf(d) -> Config` (ValueError naming any unsupported
  field or value; only fields that do not affect the math are ignored, and they are listed
  explicitly) and `Config.to_hf() -> dict` (with "model_type", a key of MODULES below, and
  "architectures"; transformers loads it);
- the nn.Modules, then `class Model(nn.Module)`: `Model(cfg)` builds on the current default device
  (so `with torch.device("meta")` allocates nothing), keeps `cfg` as `model.cfg`, and implements
  pith_engine.contract.MoEModel (layers, lm_head, prologue / positions / epilogue /
  reference_forward; layers implement DecoderLayer). Expert weights are Parameters [E_held, ...]:
  w_gate_up [E, D, 2F] (gate | up halves, the [E, in, out] layout pith_ops.grouped_gemm takes) and
  w_down [E, F, D]; stage3 uses whatever experts the module holds. Routers compute logits in fp32 and
  hold a persistent buffer `expert_bias` [E] (zeros; fp32; checkpoints carry it) added to the
  scores for top-k selection only (not to the combine weights); the trainer updates it;
- `init_weights(model, seed)`, the one initialiser (on a materialised model);
- `from_hf_state_dict(sd, cfg)` / `to_hf_state_dict(sd, cfg)`: HF names and layouts <-> ours. Both
  work on meta tensors: loading checks the file's names and shapes against
  `to_hf_state_dict(meta_model.state_dict())`, so from_hf_state_dict may assume a complete input;
- presets: TINY (tests) and the full-size configs.
"""

import json
from pathlib import Path
from types import ModuleType

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from pith_models import deepseek_v2, gpt_oss, qwen3_moe

# HF model_type -> model module: the one place a model_type string maps to code.
MODULES: dict[str, ModuleType] = {
    "qwen3_moe": qwen3_moe,
    "deepseek_v2": deepseek_v2,
    "gpt_oss": gpt_oss,
}


def module_of(cfg) -> ModuleType:
    return MODULES[cfg.to_hf()["model_type"]]


def config_from_hf(d: dict):
    model_type = d.get("model_type")
    if model_type not in MODULES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(MODULES)}")
    return MODULES[model_type].Config.from_hf(d)


def read_safetensors(path: Path) -> dict[str, Tensor]:
    """All tensors of model.safetensors, or of the shards model.safetensors.index.json names."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{path}: expected model.safetensors or model.safetensors.index.json, found neither")
    sd = {}
    for f in files:
        sd.update(load_file(path / f))
    return sd


def check_tensors(got: dict[str, Tensor], expected: dict[str, Tensor], where: str) -> None:
    """ValueError naming every missing, unexpected and wrongly shaped tensor."""
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    shapes = [
        f"{k}: expected {tuple(expected[k].shape)}, got {tuple(got[k].shape)}"
        for k in sorted(set(got) & set(expected))
        if got[k].shape != expected[k].shape
    ]
    found = {"missing tensors": missing, "unexpected tensors": unexpected, "wrong shapes": shapes}
    problems = [f"{what} {items}" for what, items in found.items() if items]
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))


def from_pretrained(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> nn.Module:
    """Load a Hugging Face directory (config.json + safetensors), strictly: every tensor must match."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: expected a Hugging Face model directory with a config.json, found none")
    cfg = config_from_hf(json.loads((path / "config.json").read_text()))
    module = module_of(cfg)
    with torch.device("meta"):
        model = module.Model(cfg)
    hf_sd = read_safetensors(path)
    check_tensors(hf_sd, module.to_hf_state_dict(model.state_dict(), cfg), str(path))
    hf_sd = {k: v.to(device, dtype) for k, v in hf_sd.items()}
    sd = {k: v.to(device) for k, v in module.from_hf_state_dict(hf_sd, cfg).items()}
    load_assign(model, sd)
    return model


def load_assign(model: nn.Module, sd: dict[str, Tensor]) -> None:
    """Strict load_state_dict(assign=True) onto a meta model, keeping tied parameters tied (assign
    alone gives each module its own Parameter, silently untying lm_head from the embedding)."""
    first: dict[int, str] = {}
    ties = []  # (name, name of the parameter it shares)
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            ties.append((name, first[id(p)]))
        else:
            first[id(p)] = name
    model.load_state_dict(sd, strict=True, assign=True)
    for name, source in ties:
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner).register_parameter(leaf, model.get_parameter(source))


def save_pretrained(model: nn.Module, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write config.json + model.safetensors that transformers' from_pretrained loads."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    hf_sd = module_of(cfg).to_hf_state_dict(model.state_dict(), cfg)
    # Fresh contiguous CPU copies: safetensors refuses views that share storage (the gate/up halves).
    hf_sd = {k: v.detach().contiguous().to("cpu", dtype, copy=True) for k, v in hf_sd.items()}
    save_file(hf_sd, path / "model.safetensors", metadata={"format": "pt"})
    config = {**cfg.to_hf(), "torch_dtype": str(dtype).removeprefix("torch.")}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
