"""Peak FLOP/s and memory; step records to metrics.jsonl, the text line, TensorBoard and W&B; plots."""

import contextlib
import hashlib
import json
import os
import resource
import time
from pathlib import Path

import torch

# Dense bf16 datasheet peaks by device-name fragment, as MFU figures use.
BF16_PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "B200": 2250e12, "A100": 312e12}


def peak_flops(device: torch.device) -> tuple[float, str]:
    """(FLOP/s, its source): a known GPU's datasheet, else a measured matmul."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for fragment, flops in BF16_PEAK_FLOPS.items():
            if fragment in name:
                return flops, f"{name} bf16 datasheet"
    n, dtype = (2048, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda device: None
    a @ a  # warm-up
    sync(device)
    start = time.perf_counter()
    for _ in range(10):
        a @ a
    sync(device)
    seconds = (time.perf_counter() - start) / 10
    return 2 * n**3 / seconds, f"measured {n}x{n} {str(dtype).removeprefix('torch.')} matmul on {device.type}"


def peak_memory_gib(device: torch.device) -> float:
    """Allocated on the GPU, resident (max RSS) on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def log_line(record: dict, total_steps: int) -> str:
    """`step N/TOTAL` then `name value` pairs, with metrics.jsonl's names."""
    r = record
    load, mfu = max(r["expert_load_max_over_mean"], default=1.0), r.get("mfu")  # mfu: a known peak's
    line = (
        f"step {r['step']}/{total_steps} loss {r['loss']:.4f} lr {r['lr']:.3e} grad_norm {r['grad_norm']:.4f}"
        f" tokens_per_s {r['tokens_per_s']:.0f}" + (f" mfu {mfu:.4f}" if mfu else "") + f" load {load:.2f}"
        f" memory_gib {r['memory_gib']:.2f}"
    )
    return line + (f" val_loss {r['val_loss']:.4f}" if "val_loss" in r else "")


def _records(path: Path) -> list[dict]:
    # A line cut short by a killed write is not a record.
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            rows.append(json.loads(line))
    return rows


class MetricsLog:
    """Each step's record, on rank 0, to RUN_DIR/metrics.jsonl, TensorBoard and W&B. A run resumed
    from step `start` retrains the steps after it: their earlier records are dropped."""

    def __init__(self, run_dir: Path, start: int, enabled, tensorboard, wandb: str, config: dict):
        self.path, self.enabled, self.tb, self.wandb = Path(run_dir) / "metrics.jsonl", enabled, None, None
        if not enabled:
            return
        if self.path.exists():
            kept = [r for r in _records(self.path) if r.get("step", 0) <= start]
            tmp = self.path.with_name("metrics.jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, self.path)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # a machine run by PYTHONPATH may lack it
                print("tensorboard is not installed: no event files (--log.tensorboard=false silences this)")
            else:
                self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=start + 1)
        if wandb:
            import wandb as wandb_mod

            # One W&B run per run directory, resumed by a later launch.
            run_id = "pith-" + hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
            self.wandb = wandb_mod.init(
                project=wandb, dir=str(run_dir), config=config, id=run_id, resume="allow"
            )

    def write(self, **record) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        scalars = {}
        for name, value in record.items():
            if isinstance(value, list):  # one per MoE layer
                scalars.update({f"{name}/layer_{i}": v for i, v in enumerate(value)})
            elif name != "step":
                scalars[name] = value
        if self.tb is not None:
            for name, value in scalars.items():
                self.tb.add_scalar(name, value, record["step"])
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(run_dir: str) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run_dir!r} has no metrics.jsonl (is it a pith-train run directory?)")
    return _records(path)


def plot(run_dir: str, out: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # A resumed run re-logs steps after its checkpoint; the latest record of a step wins.
    by_step = {r["step"]: r for r in read_metrics(run_dir)}
    steps = sorted(by_step)
    if not steps:
        raise ValueError(f"{run_dir}/metrics.jsonl has no step records yet")
    panels = [k for k in ("lr", "grad_norm", "expert_load_max_over_mean") if k in by_step[steps[0]]]
    fig, axes = plt.subplots(2 + len(panels), 1, figsize=(8, 3 + 1.8 * len(panels)), sharex=True)
    ax_loss, ax_tps = axes[:2]
    for ax, key in zip(axes[2:], panels):
        values = [by_step[s].get(key) for s in steps]
        if key == "expert_load_max_over_mean":
            for i, layer in enumerate(zip(*values)):
                ax.plot(steps, layer, label=f"layer {i}")
            ax.legend(fontsize="x-small", ncol=4)
            key = "expert load max/mean"
        else:
            ax.plot(steps, values)
        ax.set_ylabel(key)
    ax_loss.plot(steps, [by_step[s]["loss"] for s in steps], label="train")
    if val := [s for s in steps if "val_loss" in by_step[s]]:
        ax_loss.plot(val, [by_step[s]["val_loss"] for s in val], "o-", label="validation")
    ax_loss.set_ylabel("loss")
    ax_loss.legend()
    ax_tps.plot(steps, [by_step[s]["tokens_per_s"] for s in steps])
    ax_tps.set_ylabel("tokens / s")
    axes[-1].set_xlabel("step")
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    return _save(fig, Path(out) if out else Path(run_dir) / "metrics.png")


def _save(fig, out: Path) -> Path:
    """-> the file written (matplotlib adds .png to a name without a suffix)."""
    import matplotlib.pyplot as plt

    out = out if out.suffix else Path(f"{out}.png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_schedule(pp: int, micro_batches: int, out: str) -> Path:
    """PNG timeline of one step's pipeline schedule (pith_engine.schedule.timeline): a row per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from pith_engine.schedule import COSTS, Op, Overlap, timeline

    colors = {Op.F: "tab:blue", Op.B: "tab:green", Op.I: "yellowgreen", Op.W: "tab:orange"}
    rows = timeline(pp, micro_batches)
    span = max(row[-1][1] for row in rows)
    fig, ax = plt.subplots(figsize=(max(8, span / 4), 0.6 * pp + 2))
    for r, row in enumerate(rows):
        for start, _, item in row:
            for op, chunk, micro in item if isinstance(item, Overlap) else (item,):
                width = COSTS[op]
                hatch = "//" if pp > 1 and chunk >= pp else None
                edge = ("black", 0.8) if not isinstance(item, Overlap) else ("red", 2.0)
                ax.barh(r, width, left=start, color=colors[op], edgecolor=edge[0], linewidth=edge[1],
                        hatch=hatch, height=0.8)  # fmt: skip
                ax.text(start + width / 2, r, str(micro), ha="center", va="center", fontsize=7)
                start += width
    bubble = span - sum(end - start for start, end, _ in rows[0])
    ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    ax.invert_yaxis()
    ax.set_xlabel("time (a forward of one chunk = 1)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    labels = ["F", "B (input + weight)", "I (input)", "W (weight)"]
    ax.legend(handles, labels, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    ax.set_title(
        f"pp={pp}, {micro_batches} micro-batches: bubble {bubble:g} per rank of {span:g}"
        " (hatched: the rank's second chunk; red edges: one overlapped F+B action)"
    )
    fig.tight_layout()
    return _save(fig, Path(out))
