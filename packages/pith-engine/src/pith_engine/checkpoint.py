"""Checkpoints: torch.distributed.checkpoint (DCP) in a canonical layout, made visible atomically.

Canonical layout: keys are the model's own names with global layer indices (the position in
`model.layers`), and each stacked expert parameter [E, ...] is stored as E entries, one per expert:
"model.layers.3.mlp.w_gate_up" -> "model.layers.3.mlp.w_gate_up.0" ... ".{E-1}"; its optimizer state
is split the same way ("optim.state.layers.3.mlp.w_gate_up.17.exp_avg"). Nothing in it depends on how
parameters are sharded, so DCP can load a checkpoint into another layout: each rank asks for the
entries (and the slices of them) that it holds. The routers' `expert_bias` buffers (aux-loss-free
balancing state) are saved whether or not a model registers them as persistent.

A checkpoint is a directory: the DCP files, `files` written by rank 0 (the trainer's JSON, the model's
config.json) and `rng.{rank}.pt`. It is written under NAME.tmp and renamed to NAME when every rank
has finished, so a process killed while saving leaves earlier checkpoints as they were and at most a
*.tmp directory, which `prune` removes.
"""

import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

STEP_DIR = re.compile(r"step_(\d+)")


def expert_param_names(model: nn.Module) -> set[str]:
    """Full names of the stacked expert parameters: those of each layer's `experts` module (contract)."""
    holders = {id(layer.experts) for layer in model.layers if layer.experts is not None}
    return {
        f"{module_name}.{name}"
        for module_name, module in model.named_modules()
        if id(module) in holders
        for name, _ in module.named_parameters()
    }


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def split_experts(state: dict, experts: set[str]) -> dict:
    """name -> value with each name in `experts` replaced by one entry per expert (views of dim 0)."""
    out = {}
    for name, value in state.items():
        if name in experts:
            out.update({f"{name}.{e}": v for e, v in enumerate(value.unbind(0))})
        else:
            out[name] = value
    return out


def stack_experts(canonical: dict, like: dict, experts: set[str]) -> dict:
    """The inverse of split_experts; `like` (a state in the model's own form) gives names and E."""
    out = {}
    for name, v in like.items():
        out[name] = (
            torch.stack([canonical[f"{name}.{e}"] for e in range(len(v))])
            if name in experts
            else canonical[name]
        )
    return out


def _split_optim(osd: dict, experts: set[str]) -> dict:
    # A parameter's AdamW state: tensors shaped like it, plus a scalar "step" (repeated in each entry).
    state = {}
    for name, entry in osd["state"].items():
        if name in experts:
            for e in range(len(entry["exp_avg"])):
                state[f"{name}.{e}"] = {k: v if v.ndim == 0 else v[e] for k, v in entry.items()}
        else:
            state[name] = entry
    return {"state": state, "param_groups": osd["param_groups"]}


def _stack_optim(canonical: dict, like: dict, experts: set[str]) -> dict:
    state = {}
    for name, entry in like["state"].items():
        if name not in experts:
            state[name] = canonical["state"][name]
            continue
        parts = [canonical["state"][f"{name}.{e}"] for e in range(len(entry["exp_avg"]))]
        state[name] = {
            k: v if v.ndim == 0 else torch.stack([p[k] for p in parts]) for k, v in parts[0].items()
        }
    return {"state": state, "param_groups": canonical["param_groups"]}


def _bias_buffers(model: nn.Module, model_sd: dict) -> dict:
    return {n: b for n, b in model.named_buffers() if n.endswith("expert_bias") and n not in model_sd}


def save(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    files: dict[str, str] | None = None,
) -> Path:
    """Write a checkpoint of `model` (and `optimizer`) to `path`, atomically; every rank calls this."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    experts = expert_param_names(model)
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    model_sd = get_model_state_dict(model)
    state = {"model": split_experts(model_sd, experts), "buffers": _bias_buffers(model, model_sd)}
    if optimizer is not None:
        state["optim"] = _split_optim(get_optimizer_state_dict(model, optimizer), experts)
    dcp.save(state, checkpoint_id=tmp, no_dist=not dist.is_initialized())
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, tmp / f"rng.{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        for name, text in (files or {}).items():
            (tmp / name).write_text(text)
        shutil.rmtree(path, ignore_errors=True)  # saving the same step again replaces it
        tmp.rename(path)
    _barrier()
    return path


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a checkpoint, saved under any layout, into `model` and (when given) `optimizer`."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise ValueError(f"{str(path)!r} is not a Pith checkpoint (it has no DCP .metadata file)")
    experts = expert_param_names(model)
    model_sd = get_model_state_dict(model)
    buffers = _bias_buffers(model, model_sd)
    # Fresh tensors to load into (views of model_sd would write through into parameters mid-load).
    state = {
        "model": {k: v.clone() for k, v in split_experts(model_sd, experts).items()},
        "buffers": {k: v.clone() for k, v in buffers.items()},
    }
    if optimizer is not None:
        optim_sd = get_optimizer_state_dict(model, optimizer)
        state["optim"] = _split_optim(optim_sd, experts)
    dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
    set_model_state_dict(model, stack_experts(state["model"], model_sd, experts))
    with torch.no_grad():
        for name, b in buffers.items():
            b.copy_(state["buffers"][name])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, _stack_optim(state["optim"], optim_sd, experts))
    rng_file = path / f"rng.{_rank()}.pt"
    if rng_file.is_file():  # absent when resuming with more ranks than were saved: fresh streams then
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])


def checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints root/step_NNNNNN, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(STEP_DIR.fullmatch(p.name)[1]))


def prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints under root; remove *.tmp left by a killed save. Rank 0 only."""
    if _rank() != 0:
        return
    for stale in Path(root).glob("*.tmp"):
        shutil.rmtree(stale)
    for old in checkpoints(root)[:-keep]:
        shutil.rmtree(old)
