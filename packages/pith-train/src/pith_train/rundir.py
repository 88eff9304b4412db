"""The run directory across launches (pith-train README): a fresh start where a run is would mix the
two, and `prune` would delete the new checkpoints."""

import dataclasses
import importlib.util
import json
import math
import os
import tempfile
from operator import attrgetter
from pathlib import Path

from pith_engine import checkpoint

from pith_train import config as config_mod
from pith_train.config import Config
from pith_train.data import PackedDataset, blend_counts
from pith_train.optim import lr_at

# The learning-rate schedule's [optim] keys (checked against the steps trained).
SCHEDULE = ("schedule", "warmup_steps", "min_lr_ratio", "decay_fraction")
# The keys that decide which sequences each step trains on: datasets by content (data_ids),
# data.val_windows where it picks held-out training windows (without data.val_path).
DATA_ORDER = ("data.path", "data.val_path", "data.weights", "data.val_windows", "data.seq_len", "train.seed",
              "train.global_batch")  # fmt: skip


def read_json(path: Path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read it as JSON ({e})") from None


def check_writable(directory: Path) -> None:
    """ValueError unless `directory` (or its nearest existing parent) takes files; creates nothing."""
    existing = Path(directory)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is not a directory")
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as e:
        raise ValueError(f"{directory} cannot be written ({e}): fix it or choose another --run-dir") from None


def refuse_history(run_dir: Path, why: str, config: bool = True) -> None:
    """ValueError if earlier launches left files in run_dir (with `config` its config.toml)."""
    found = [*Path(run_dir, "checkpoints").glob("step_*")]
    found += [run_dir / n for n in ("metrics.jsonl", "metrics.png", *["config.toml"] * config)]
    if (run_dir / "metrics.jsonl").exists():  # event files alone: a launch that trained no step
        found += Path(run_dir, "tensorboard").glob("events.*")
    if held := sorted(str(p.relative_to(run_dir)) for p in found if p.exists()):
        raise ValueError(
            f"{why}, but {run_dir} holds an earlier run ({', '.join(held)}): choose a new --run-dir, or"
            " move those files away (nothing was changed)"
        )


def _model_check(ckpt: Path, cfg: Config, model_hf: dict, what: str) -> None:
    saved_model = read_json(ckpt / "config.json")
    model_hf = json.loads(json.dumps(model_hf))  # tuples as lists, as the file has them
    if saved_model != model_hf:
        changed = sorted(k for k in {*saved_model, *model_hf} if saved_model.get(k) != model_hf.get(k))
        raise ValueError(
            f"cannot {what} {ckpt}: it holds another model than model.name={cfg.model.name!r} builds"
            f" (config.json differs in {changed}); use that model, or another --run-dir"
        )


def data_ids(cfg: Config, strict: bool = True) -> dict:
    """What of the data decides the order: the datasets by content; not strict: a path with no dataset
    (a saved run's, moved since) as itself."""

    def one(path: str, key: str) -> str:
        ok = strict or (Path(path) / "meta.json").is_file()
        return PackedDataset(path, key).fingerprint() if ok else path

    ids = {k: [one(p, k) for p in attrgetter(k)(cfg)] for k in DATA_ORDER[:2]}
    ids["data.weights"] = blend_counts(cfg.data.weights).tolist()  # the shares, as the order sees them
    return ids | {"data.path": ids["data.path"] or [f"built-in, {cfg.data.tokenizer}"]}


def _saved(ckpt: Path, cfg: Config) -> tuple[Config, dict, list[str]]:
    """The run's config and trainer.json in `ckpt`, and what of `cfg` would change its data order."""
    saved, state = config_mod.load_config(str(ckpt / "config.toml")), read_json(ckpt / "trainer.json")
    if saved.optim.name != cfg.optim.name:
        raise ValueError(
            f"{ckpt} holds {saved.optim.name}'s optimizer state: set optim.name={saved.optim.name}"
        )
    then, now = state.get("data") or data_ids(saved, False), data_ids(cfg)
    held = not (saved.data.val_path and cfg.data.val_path)  # data.val_windows picks training windows
    changes = []
    for k in DATA_ORDER:
        a, b = attrgetter(k)(saved), attrgetter(k)(cfg)
        if (then[k] != now[k] if k in then else a != b) and (k != "data.val_windows" or held):
            a, b = (then[k], now[k]) if a == b == [] else (a, b)  # the built-in corpus, by tokenizer
            changes.append(f"{k} {a!r} -> {b!r}" + " (other data there)" * (a == b))
    return saved, state, changes


def _steps(steps: list[int]) -> str:
    """1-based step numbers as runs: 'steps 13-120', 'step 4, steps 7-9'."""
    runs = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(f"step {a + 1}" if a == b else f"steps {a + 1}-{b + 1}" for a, b in runs)


def check_resume(ckpt: Path, cfg: Config, model_hf: dict, warn) -> None:
    """ValueError unless `cfg` can continue the run saved in `ckpt`; optimizer settings may change."""
    _model_check(ckpt, cfg, model_hf, "resume")
    if not (ckpt / "config.toml").is_file():
        return
    saved, state, changed = _saved(ckpt, cfg)
    extend = f"--checkpoint.init_from={ckpt} in a new --run-dir (its weights and optimizer state, a new run)"
    if changed:
        raise ValueError(
            f"cannot resume {ckpt}: {', '.join(changed)} would change which sequences the remaining"
            f" steps train on; keep the run's values, or start {extend}"
        )
    then, now = dataclasses.asdict(saved.optim), dataclasses.asdict(cfg.optim)
    if changed := [
        f"optim.{k} {then[k]} -> {v}" for k, v in now.items() if k not in SCHEDULE and then[k] != v
    ]:
        warn(f"resuming with the config's optimizer settings, not the run's: {', '.join(changed)}")
    step = state["step"]
    if wrong := [s for s in range(step) if not math.isclose(lr_at(s, saved), lr_at(s, cfg), rel_tol=1e-9)]:
        s = wrong[0]
        raise ValueError(
            f"cannot resume {ckpt}: the new learning-rate schedule disagrees with {_steps(wrong)} of the"
            f" {step} steps trained (step {s + 1} trained at lr {lr_at(s, saved):.6g}, the new schedule"
            f" gives {lr_at(s, cfg):.6g}). To train longer, plan it with optim.schedule = 'wsd' before its"
            f" decay, or continue with this config's schedule from step 0: {extend}"
        )


def check_init(cfg: Config, model_hf: dict, mesh, warn) -> tuple[Path, int]:
    """checkpoint.init_from, checked, and the data position: its run's if the data order is the same."""
    ckpt = Path(cfg.checkpoint.init_from)
    if not (ckpt / ".metadata").is_file():
        raise ValueError(f"checkpoint.init_from={str(ckpt)!r} is not a Pith checkpoint (no DCP .metadata)")
    if wrong := checkpoint.problem(ckpt, mesh):
        raise ValueError(f"checkpoint.init_from={str(ckpt)!r} is damaged: {wrong}")
    _model_check(ckpt, cfg, model_hf, "start from")
    if not (ckpt / "trainer.json").is_file():  # convert's (a config.toml carried along or not)
        raise ValueError(
            f"{ckpt} is weights only (no optimizer state or data position): use --model.name={ckpt}"
        )
    _, trained, changed = _saved(ckpt, cfg)
    cursor = 0 if changed else trained["cursor"]
    warn(
        f"starting from {ckpt} (step {trained['step']} of its run): its weights and optimizer state, this"
        f" config's schedule from step 0, the data from sequence {cursor}"
    )
    return ckpt, cursor


def preflight(cfg: Config, run_dir: Path, model_cfg, mesh, warn) -> Path | None:
    """A launch's checks, before anything is built: -> the checkpoint to resume from (None: new run)."""
    at = run_dir.resolve()
    ckpts = (
        at.name == "checkpoints" and at.is_dir() and any((c / ".metadata").is_file() for c in at.iterdir())
    )
    if ckpts or any((p / ".metadata").is_file() or (p / "tokens.bin").is_file() for p in [at, *at.parents]):
        raise ValueError(
            f"--run-dir {run_dir} is in a checkpoint, a dataset or a run's checkpoints/: choose another"
        )
    ckpt_root = run_dir / "checkpoints"
    check_writable(ckpt_root)
    if (o := cfg.optim).warmup_steps >= cfg.train.steps:
        warn(
            f"warning: optim.warmup_steps={o.warmup_steps} >= train.steps={cfg.train.steps}: the learning"
            f" rate peaks at {lr_at(cfg.train.steps - 1, cfg):.3g} in the last step (train.lr"
            f" {cfg.train.lr:g}) and never decays"
        )
    if cfg.log.wandb and importlib.util.find_spec("wandb") is None:
        raise ValueError(
            f"log.wandb={cfg.log.wandb!r}, but wandb is not installed: pip install wandb, or unset it"
        )
    if not cfg.checkpoint.resume:
        refuse_history(run_dir, "checkpoint.resume is false")
        return None
    resume_from = checkpoint.latest_intact(ckpt_root, mesh, warn)
    if resume_from is None:  # a config.toml alone: a launch that stopped before its first step
        refuse_history(run_dir, "there is no intact checkpoint to resume from", config=False)
    else:
        check_resume(resume_from, cfg, model_cfg.to_hf(), warn)
    return resume_from


def write_config(run_dir: Path, cfg: Config) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "config.toml.tmp"
    tmp.write_text(config_mod.to_toml(cfg), encoding="utf-8")
    os.replace(tmp, run_dir / "config.toml")
