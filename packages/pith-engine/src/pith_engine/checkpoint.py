"""Checkpoints: torch.distributed.checkpoint (DCP) in a canonical, layout-independent layout, made
visible atomically, with a manifest verified before loading (pith-engine README, Checkpoints)."""

import hashlib
import json
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import pith_ops
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pith_ops.fp8_quant import FP8_MAX, FP8Weight, weight_amax
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.fsdp import FSDPModule

from pith_engine.fp8 import FP8Switch, fp8_weights
from pith_engine.parallel import SINGLE, Mesh, expert_param_names, held_experts

STEP_DIR = re.compile(r"step_(\d+)")


def _distributed(mesh: Mesh) -> bool:
    return mesh.reduce_group is not None


def _rank(mesh: Mesh) -> int:
    return dist.get_rank() if _distributed(mesh) else 0


def _barrier(mesh: Mesh) -> None:
    if _distributed(mesh):
        dist.barrier()


def _dcp(fn, state: dict, path: Path, mesh: Mesh) -> None:
    # Without process groups DCP warns at every call that it assumes one process: the intent here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        fn(state, checkpoint_id=path, no_dist=not _distributed(mesh))


class CorruptCheckpoint(ValueError):
    """A checkpoint whose files do not match its manifest (or that has none)."""


def _my_share(items: list, mesh: Mesh) -> list:
    """Every rank hashes a slice of the files (SHA-256 with SHA-NI: ~400 MiB/s a core, a few s/GB a rank)."""
    return items[_rank(mesh) :: dist.get_world_size()] if _distributed(mesh) else items


def _all_ranks(obj, mesh: Mesh) -> list:
    if not _distributed(mesh):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _digest(path: Path) -> dict:
    with open(path, "rb") as f:
        return {"bytes": path.stat().st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


def _write_manifest(tmp: Path, mesh: Mesh) -> None:
    names = sorted(p.name for p in tmp.iterdir() if p.is_file())
    files = {}
    for part in _all_ranks({n: _digest(tmp / n) for n in _my_share(names, mesh)}, mesh):
        files.update(part)
    if _rank(mesh) == 0:
        (tmp / "manifest.json").write_text(json.dumps({"files": files}, indent=1))


def problem(path: Path, mesh: Mesh = SINGLE) -> str | None:
    """What is wrong with checkpoint `path` (a missing, resized or changed file), or None if intact."""
    path = Path(path)
    try:
        files = json.loads((path / "manifest.json").read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"manifest.json is missing or unreadable ({e})"
    found = []
    for name in _my_share(sorted(files), mesh):
        want, f = files[name], path / name
        if not f.is_file():
            found.append(f"{name} is missing")
        elif f.stat().st_size != want["bytes"]:
            found.append(f"{name} has {f.stat().st_size} bytes, the manifest says {want['bytes']}")
        elif _digest(f)["sha256"] != want["sha256"]:
            found.append(f"{name} does not match its SHA-256 in the manifest (its bytes changed)")
    found = [p for part in _all_ranks(found, mesh) for p in part]
    return "; ".join(found) or None


def _split_experts(state: dict[str, Tensor], experts: set[str], mesh: Mesh) -> dict[str, Tensor]:
    out = {}
    for name, t in state.items():
        if name in experts:
            out.update({f"{name}.{e}": v for e, v in held_experts(t, mesh)})
        else:
            out[name] = t
    return out


def _split_optim(osd: dict, experts: set[str], mesh: Mesh) -> dict:
    # A parameter's AdamW state: tensors shaped like it, plus a scalar "step" (repeated per expert).
    state = {}
    for name, entry in osd["state"].items():
        if name not in experts:
            state[name] = entry
            continue
        per_key = {k: held_experts(v, mesh) for k, v in entry.items() if v.ndim > 0}
        scalars = {k: v for k, v in entry.items() if v.ndim == 0}
        for i, (e, _) in enumerate(next(iter(per_key.values()))):
            state[f"{name}.{e}"] = {**scalars, **{k: held[i][1] for k, held in per_key.items()}}
    # Not the param groups: they name this rank's parameters (other ones on each pipeline rank), and
    # their settings (betas, eps, weight decay) are the config's, which a resume may change.
    return {"state": state}


def _fp8_scales(model: nn.Module, mesh: Mesh, kept_only: bool) -> tuple[dict[str, Tensor], list]:
    """The FP8 weights' kept copies' scales -> (canonical entries, [(weight, scales [B], entry names)]);
    not kept_only: zeros to load into, for the weights that would keep copies."""
    experts = expert_param_names(model)
    fp8 = {p for m in model.modules() if isinstance(m, FP8Switch) and m.fp8 for _, p in fp8_weights(m)}
    entries, weights = {}, []
    for name, p in model.named_parameters():
        if p not in fp8 or not FP8Switch.keeps_copies(p) or not p.numel():
            continue
        kept = pith_ops.kept_copy(p, torch.float8_e4m3fn)
        if kept_only and kept is None:
            continue
        B = p.shape[0] if p.ndim == 3 else 1  # quantize_weight's batch entries
        scale_B = kept.scale_rows.reshape(B, -1)[:, 0] if kept_only else torch.zeros(B, device=p.device)
        mine = _split_experts({name: scale_B}, experts, mesh)
        entries.update(mine)
        weights.append((p, scale_B, list(mine)))
    return entries, weights


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None, mesh: Mesh) -> tuple[dict, dict | None]:
    experts = expert_param_names(model)
    # The sharded parameters: a forward without backward (evaluation) leaves the FSDP root unsharded.
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    state = {
        "model": _split_experts({n: p.detach() for n, p in model.named_parameters()}, experts, mesh),
        "buffers": {n: b for n, b in model.named_buffers() if n.endswith("expert_bias")},
    }
    osd = None
    if optimizer is not None:
        osd = get_optimizer_state_dict(model, optimizer)
        state["optim"] = _split_optim(osd, experts, mesh)
    return state, osd


def save(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    files: dict[str, str] | None = None,
    mesh: Mesh = SINGLE,
) -> Path:
    """Write a checkpoint of `model` (and `optimizer`) to `path`, atomically; every rank calls this."""
    path = Path(path)
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    rank = _rank(mesh)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name, text in (files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
    _barrier(mesh)
    state, _ = _state(model, optimizer, mesh)
    state["fp8_scale"] = _fp8_scales(model, mesh, kept_only=True)[0]
    _dcp(dcp.save, state, tmp, mesh)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, tmp / f"rng.{rank}.pt")
    _barrier(mesh)
    _write_manifest(tmp, mesh)
    if rank == 0:
        if path.exists():  # the same step again: the old copy stays until the new one is in place
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    _barrier(mesh)
    return path


def load(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    mesh: Mesh = SINGLE,
    verify: bool = True,
) -> None:
    """Load a checkpoint, saved under any layout, into `model` (and `optimizer`), in place.
    verify: check the manifest first; False when the caller just did."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise ValueError(f"{str(path)!r} is not a Pith checkpoint (it has no DCP .metadata file)")
    if verify and (wrong := problem(path, mesh)):
        raise CorruptCheckpoint(f"checkpoint {path} is damaged: {wrong}")
    state, osd = _state(model, optimizer, mesh)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    entries, fp8 = _fp8_scales(model, mesh, kept_only=False)
    state["fp8_scale"] = {k: v for k, v in entries.items() if f"fp8_scale.{k}" in saved}
    if optimizer is not None:  # e.g. AdamW's exp_avg where Muon wants a momentum_buffer
        wanted = [f"optim.state.{n}.{k}" for n, entry in state["optim"]["state"].items() for k in entry]
        if missing := [k for k in wanted if k not in saved]:
            raise ValueError(
                f"{str(path)!r} has no optimizer state {missing[0]} (and {len(missing) - 1} more): resume"
                " with the optimizer it was saved with (optim.name), or in a new run directory"
            )
    with torch.no_grad():
        _dcp(dcp.load, state, path, mesh)
        for w, scale_B, names in fp8:  # the copies as the update wrote them (448 * scale gives scale)
            if all(n in state["fp8_scale"] for n in names):
                copies = pith_ops.quantize_weight(w.detach(), scale_B * FP8_MAX)
                pith_ops.keep(w, FP8Weight(*copies, weight_amax(w)), torch.float8_e4m3fn)
    if optimizer is not None:  # the entries were views of osd's tensors; its groups are the optimizer's
        set_optimizer_state_dict(model, optimizer, osd)
    rng_file = path / f"rng.{_rank(mesh)}.pt"
    if rng_file.is_file():  # absent when resuming with more ranks than were saved: fresh streams then
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])


def checkpoints(root: Path) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(STEP_DIR.fullmatch(p.name)[1]))


def tidy(root: Path) -> None:
    """After a killed save: remove *.tmp, and put back a NAME.old whose replacement never arrived."""
    for stale in Path(root).glob("*.tmp"):
        shutil.rmtree(stale)
    for old in Path(root).glob("*.old"):
        new = old.with_name(old.name.removesuffix(".old"))
        shutil.rmtree(old) if new.exists() else old.rename(new)


def prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints under root, and the NAME.damaged ones newer than the oldest
    kept (to be looked at); tidy what a killed save left. Rank 0 only."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    tidy(root)
    found = checkpoints(root)
    step = lambda p: int(STEP_DIR.fullmatch(p.name.removesuffix(".damaged"))[1])
    oldest = step(found[-keep]) if len(found) >= keep else 0
    for old in [*found[:-keep], *(p for p in Path(root).glob("*.damaged") if step(p) < oldest)]:
        shutil.rmtree(old)


def latest_intact(root: Path, mesh: Mesh = SINGLE, warn: Callable[[str], None] = print) -> Path | None:
    """The newest intact checkpoint under root (None: no checkpoint); each damaged newer one is renamed
    NAME.damaged (over an older one) after `warn` names what is wrong; ValueError when none is intact.
    Every rank calls this."""
    if _rank(mesh) == 0:
        tidy(root)
    _barrier(mesh)
    found = checkpoints(root)
    for path in reversed(found):
        wrong = problem(path, mesh)
        if wrong is None:
            return path
        if _rank(mesh) == 0:
            shutil.rmtree(aside := path.with_name(path.name + ".damaged"), ignore_errors=True)
            path.rename(aside)
            warn(f"warning: checkpoint {path} is damaged ({wrong}); moved it to {path.name}.damaged")
        _barrier(mesh)
    if found:
        raise ValueError(f"no intact checkpoint in {root}: every one was damaged (moved to *.damaged)")
    return None
