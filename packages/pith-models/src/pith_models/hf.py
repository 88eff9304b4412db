"""Hugging Face interop: a directory of config.json + *.safetensors <-> a pith model.

Model-module convention (every family file follows it; this file relies on nothing else of theirs):
- a docstring listing the architectural choices;
- `@dataclass(frozen=True) class Config`: a comment per field, `tie_word_embeddings`, validated in
  __post_init__; `from_hf(d)` (ValueError naming any unsupported field or value; ignored fields listed;
  pith_models.hf_convert), `to_hf()` (with "architectures" and "model_type", a key of MODULES);
- its modules, then `Model(cfg)`, a pith_engine.layers.DecoderModel implementing
  pith_engine.contract.MoEModel, built on the default device. Expert weights are Parameters
  [E_held, in, out]; routers compute fp32 logits and hold a persistent fp32 buffer `expert_bias` [E]
  added for top-k selection only; `init_weights(model, seed, mesh=SINGLE)`;
- `from_hf_state_dict(sd, cfg, experts=None)` / `to_hf_state_dict(sd, cfg)`: HF names and layouts <->
  ours. to_hf_state_dict works on meta tensors (loading checks the file against it first: from_hf may
  assume every name present). `sd` holds the routed experts `experts` (global indices): a stacked HF
  tensor sliced to them, a per-expert one `...experts.<e>...` only for e in it. Every other tensor
  must come out made of HF rows along dim 0 (renamed, concatenated, permuted, tied), from HF tensors
  possibly cut to some rows: a sharded load runs it on int64 row ids;
- presets: TINY (tests) and the full-size configs.
"""

import contextlib
import itertools
import json
import os
import re
from pathlib import Path
from types import ModuleType

import torch
from pith_engine.parallel import SINGLE, Mesh, expert_param_names, local_rows, parallelize
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from pith_models import deepseek_v2, gpt_oss, qwen3_moe

# The one place a model_type string maps to code.
MODULES: dict[str, ModuleType] = {"qwen3_moe": qwen3_moe, "deepseek_v2": deepseek_v2, "gpt_oss": gpt_oss}


def module_of(cfg) -> ModuleType:
    return MODULES[cfg.model_type]


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


# GPT-OSS's MXFP4: e2m1 values by nibble, and by byte its (low, high) nibbles'
_FP4 = torch.tensor([0.0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
_FP4_PAIRS = torch.stack([_FP4.repeat(16), _FP4.repeat_interleave(16)], -1)


def dequantize_mxfp4(blocks: Tensor, scales: Tensor) -> Tensor:
    """uint8 [E, O, G, 16], exponents + 127 [E, O, G] -> fp32 [E, G*32, O], transformers' values. An
    expert at a time: an int index per byte of all is 4x the blocks."""
    out = torch.empty(*scales.shape, 32)
    for e in range(len(out)):
        out[e] = torch.ldexp(_FP4_PAIRS[blocks[e].int()].flatten(-2), scales[e, ..., None].int() - 127)
    return out.flatten(-2).transpose(1, 2)


def read_safetensors(path: Path, rows: dict[str, range] | None = None) -> dict[str, Tensor]:
    """The tensors `rows` names, only those rows of dim 0 (nothing else read); rows None: all as meta
    tensors. MXFP4 X_blocks and X_scales come as X, dequantised."""
    sd = {}
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(safe_open(path / f, framework="pt")) for f in _files(path)]
        where = {k: file for file in files for k in file.keys()}  # noqa: SIM118 (no __iter__)
        for k, file in where.items():
            x, piece = k.removesuffix("_blocks").removesuffix("_scales"), file.get_slice(k)
            if x != k and not {x + "_blocks", x + "_scales"} <= where.keys():
                raise ValueError(f"{path}: {k} without its MXFP4 partner")
            if k.endswith("_scales"):
                continue
            if rows is None:
                s = piece.get_shape()
                sd[x] = torch.empty(s if k == x else (s[0], s[2] * 32, s[1]), device="meta")
            elif x in rows:
                r = slice(rows[x].start, rows[x].stop)
                mx = k != x and dequantize_mxfp4(piece[r], where[x + "_scales"].get_slice(x + "_scales")[r])
                sd[x] = piece[r] if k == x else mx
    return sd


def check_tensors(got: dict[str, Tensor], expected: dict[str, Tensor], where: str) -> None:
    found = {
        "missing tensors": sorted(set(expected) - set(got)),
        "unexpected tensors": sorted(set(got) - set(expected)),
        "wrong shapes": [
            f"{k}: expected {tuple(t.shape)}, got {tuple(got[k].shape)}"
            for k, t in sorted(expected.items())
            if k in got and got[k].shape != t.shape
        ],
    }
    if problems := [f"{what} {items}" for what, items in found.items() if items]:
        raise ValueError(f"{where}: " + "; ".join(problems))


def build_empty(cfg, device="meta", mesh: Mesh | None = None, param_dtype=None) -> nn.Module:
    """Built on meta, cut to this rank's part under `mesh`, materialised on `device` uninitialised."""
    with torch.device("meta"):
        model = module_of(cfg).Model(cfg)
    if mesh is not None:
        parallelize(model, mesh, param_dtype)
    if torch.device(device).type != "meta":
        model.to_empty(device=device)  # which unties: tie again
        if cfg.tie_word_embeddings and hasattr(model, "lm_head"):
            model.lm_head.weight = model.embed_tokens.weight
    return model


def _held_experts(model: nn.Module, mesh: Mesh) -> range:
    for name, p in model.named_parameters():
        if name in expert_param_names(model):
            rows, first = local_rows(p)[1], mesh.ep_rank * p.shape[0]
            return range(first + rows.start, first + rows.stop)
    return range(0)


def _wanted(ids: Tensor, p: Tensor, name: str, module: ModuleType, experts) -> Tensor:
    """HF row ids of this rank's rows of p."""
    if name in experts:
        return ids.flatten(1)
    if ids.dtype != torch.int64 or ids.numel() != ids.shape[0] or ids.shape[0] != p.shape[0]:
        raise ValueError(
            f"{module.__name__}.from_hf_state_dict turns int64 HF row ids into {name} "
            f"{tuple(ids.shape)} {ids.dtype}: expected {p.shape[0]} int64 ids, one HF row per row of dim 0"
        )
    return ids.flatten()[local_rows(p)[1]]


def _part(r: range, j: int, n: int) -> range:
    return r[j * len(r) // n : (j + 1) * len(r) // n]  # the j-th of n pieces


@torch.no_grad()
def from_pretrained(
    path: str | Path, device: str | torch.device = "cpu", mesh: Mesh | None = None, param_dtype=None, chunk=0
) -> nn.Module:
    """Load strictly (every tensor must match), fp32; under `mesh` reading only this rank's part (how:
    pith-models README); `chunk` HF elements at a time (0: a quarter of the largest tensor's)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: expected a Hugging Face model directory with a config.json, found none")
    cfg = config_from_hf(json.loads((path / "config.json").read_text()))
    module = module_of(cfg)
    shapes = read_safetensors(path)
    check_tensors(shapes, module.to_hf_state_dict(build_empty(cfg).state_dict(), cfg), str(path))
    model = build_empty(cfg, device, mesh, param_dtype)
    held = _held_experts(model, mesh or SINGLE)
    expert = {k: int(e[1]) for k in shapes if (e := _PER_EXPERT.search(k))}
    seen = {  # rows passed: the held experts', all of the rest
        k: held if ".experts." in k and k not in expert else range(len(t))
        for k, t in shapes.items()
        if k not in expert or expert[k] in held
    }
    first = dict(zip(seen, [0, *itertools.accumulate(len(r) for r in seen.values())]))
    ids = {
        k: torch.arange(first[k], first[k] + len(r)).view(-1, *[1] * (shapes[k].ndim - 1))
        for k, r in seen.items()
    }
    origin = module.from_hf_state_dict(ids, cfg, held)
    experts = expert_param_names(model)
    wanted = {name: _wanted(origin[name], p, name, module, experts) for name, p in model.named_parameters()}
    need = torch.cat([w.flatten() for w in wanted.values()]).unique()
    cut = {}
    for k, r in seen.items():
        lo, hi = torch.searchsorted(need, torch.tensor([first[k], first[k] + len(r)])).tolist()
        cut[k] = range(int(need[lo]) - first[k], int(need[hi - 1]) - first[k] + 1) if hi > lo else range(0)
    # A layer (the embedding, norm and lm_head: one more) in n passes of the j-th of n pieces of its held
    # experts and other tensors' rows (their memory: pith-models README, Hugging Face interop).
    layer = {k: k.split(".")[2] if k.startswith("model.layers.") else "" for k in seen}
    chunk = chunk or max(t.numel() for t in shapes.values()) // 4
    left = sum(len(w) for w in wanted.values())  # rows still to read
    for g in set(layer.values()):
        mine = {k: c if layer[k] == g else range(0) for k, c in cut.items()}
        n = -(-sum(len(c) * shapes[k][0].numel() for k, c in mine.items()) // chunk)
        for j in range(n):
            part = _part(held, j, n)
            hold = part or held  # no part: `held`, per-expert tensors empty
            rows = {k: _part(c, j, n) for k, c in mine.items() if k not in expert}
            rows |= {k: mine[k] if part else range(0) for k in expert if expert[k] in hold}
            sd = read_safetensors(path, {k: seen[k][r.start : r.stop] for k, r in rows.items()})
            sd = module.from_hf_state_dict(sd, cfg, hold)
            got = module.from_hf_state_dict({k: ids[k][r.start : r.stop] for k, r in rows.items()}, cfg, hold)
            for name, p in model.named_parameters():
                if got[name].numel():  # rows by their least HF id
                    have, order = got[name].unsqueeze(-1).flatten(1).amin(1).sort()
                    want, local = wanted[name].unsqueeze(-1).flatten(1).amin(1), local_rows(p)[0]
                    hit = torch.isin(want, have)
                    src = sd[name][order[torch.searchsorted(have, want[hit])]]  # read on the CPU
                    local[hit.to(local.device)] = src.to(local.device, local.dtype)
                    left -= int(hit.sum())
            for name, b in model.named_buffers():
                b.copy_(sd[name])
            del sd, got
    if left:
        raise RuntimeError(f"{path}: {left} rows of this rank's parameters were never read")
    return model


def save_pretrained(model: nn.Module, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write config.json + model.safetensors that transformers' from_pretrained loads."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    hf_sd = module_of(cfg).to_hf_state_dict(model.state_dict(), cfg)
    # Copies: safetensors refuses views sharing storage (the gate/up halves).
    hf_sd = {k: v.detach().contiguous().to("cpu", dtype, copy=True) for k, v in hf_sd.items()}
    save_file(hf_sd, path / "model.safetensors", metadata={"format": "pt"})
    os.umask(umask := os.umask(0))  # safetensors writes 0600: the user's umask decides, as for any file
    os.chmod(path / "model.safetensors", 0o666 & ~umask)
    config = {**cfg.to_hf(), "torch_dtype": str(dtype).removeprefix("torch.")}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
