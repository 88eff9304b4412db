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
- `Model(cfg, layer_ids=None)` builds the layers of those global indices only (pith_engine.layers.
  DecoderModel); `init_weights(model, seed, mesh=SINGLE)`, the one initialiser (on a materialised
  model, sharded over `mesh` or whole; the same global weights either way);
- `from_hf_state_dict(sd, cfg, experts=None)` / `to_hf_state_dict(sd, cfg)`: HF names and layouts
  <-> ours. Both work on meta tensors: loading checks the file's names and shapes against
  `to_hf_state_dict(meta_model.state_dict())`, so from_hf_state_dict may assume a complete input,
  except for the routed experts: `experts` (a range of global expert indices, default all) are the
  ones `sd` holds, the only ones a sharded load reads (a stacked HF expert tensor [E, ...] comes
  sliced to them, a per-expert one `...experts.<e>...` only for e in the range); their stacked
  weights come out [len(experts), ...];
- presets: TINY (tests) and the full-size configs.
"""

import json
import re
from pathlib import Path
from types import ModuleType

import torch
from pith_engine.parallel import SINGLE, Mesh, expert_param_names, local_rows, parallelize
from safetensors import safe_open
from safetensors.torch import save_file
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


_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _files(path: Path) -> list[str]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    if (path / "model.safetensors").exists():
        return ["model.safetensors"]
    raise ValueError(f"{path}: expected model.safetensors or model.safetensors.index.json, found neither")


def read_safetensors(path: Path, experts: range | None = None, meta: bool = False) -> dict[str, Tensor]:
    """The tensors of model.safetensors, or of the shards model.safetensors.index.json names; with
    `experts`, of the routed experts only those global indices (slices of stacked ones [E, ...]: the
    rest is never read); meta: only their shapes, as meta tensors, reading no data."""
    sd = {}
    for f in _files(path):
        with safe_open(path / f, framework="pt") as file:
            for k in file.keys():  # noqa: SIM118 (a safe_open handle has no __iter__)
                e = _PER_EXPERT.search(k)
                if meta:
                    sd[k] = torch.empty(file.get_slice(k).get_shape(), device="meta")
                elif experts is None or (e is None and ".experts." not in k):
                    sd[k] = file.get_tensor(k)
                elif e is None:
                    sd[k] = file.get_slice(k)[experts.start : experts.stop]
                elif int(e[1]) in experts:
                    sd[k] = file.get_tensor(k)
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


def build_empty(cfg, device="meta", mesh: Mesh | None = None, param_dtype=None, layer_ids=None) -> nn.Module:
    """The model of `cfg` built on the meta device, cut to this rank's part under `mesh` (its experts
    and FSDP shards, pith_engine.parallel.parallelize), then materialised on `device` uninitialised."""
    with torch.device("meta"):
        model = module_of(cfg).Model(cfg, layer_ids)
    if mesh is not None:
        parallelize(model, mesh, param_dtype)
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
        if cfg.tie_word_embeddings and hasattr(
            model, "lm_head"
        ):  # to_empty off meta gives each module a Parameter of its own
            model.lm_head.weight = model.embed_tokens.weight
    return model


def _held_experts(model: nn.Module, mesh: Mesh) -> range:
    """The global indices of the routed experts this rank holds (the same in every MoE layer)."""
    for name, p in model.named_parameters():
        if name in expert_param_names(model):
            rows, first = local_rows(p)[1], mesh.ep_rank * p.shape[0]
            return range(first + rows.start, first + rows.stop)
    return range(0)


@torch.no_grad()
def from_pretrained(
    path: str | Path, device: str | torch.device = "cpu", mesh: Mesh | None = None, param_dtype=None
) -> nn.Module:
    """Load a Hugging Face directory (config.json + safetensors), strictly: every tensor must match.

    Weights come out fp32 (the master weights). mesh: this rank's part only (as pith_models.build),
    reading only its experts from the files (the dense tensors are read whole, then cut to the FSDP
    shard); the same global weights as a single-process load."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: expected a Hugging Face model directory with a config.json, found none")
    cfg = config_from_hf(json.loads((path / "config.json").read_text()))
    module = module_of(cfg)
    expected = module.to_hf_state_dict(build_empty(cfg).state_dict(), cfg)
    check_tensors(read_safetensors(path, meta=True), expected, str(path))
    model = build_empty(cfg, device, mesh, param_dtype)
    held = _held_experts(model, mesh or SINGLE)
    sd = module.from_hf_state_dict(read_safetensors(path, held), cfg, held)
    experts = expert_param_names(model)
    for name, p in model.named_parameters():
        local, rows = local_rows(p)
        local.copy_(sd[name] if name in experts else sd[name][rows.start : rows.stop])
    for name, b in model.named_buffers():
        b.copy_(sd[name])
    return model


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
