"""Throughput accounting (FLOPs per token, peak FLOP/s, MFU), the metrics file, and `plot`."""

import json
import time
from pathlib import Path

import torch

# Dense bf16 tensor-core peaks from the vendors' datasheets (no sparsity), by device-name fragment.
# This is the convention MFU figures are usually quoted in (H100 SXM 989 TFLOP/s).
BF16_PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "B200": 2250e12, "A100": 312e12}


def peak_flops(device: torch.device) -> tuple[float, str]:
    """(FLOP/s, where the number comes from): the datasheet for a known GPU, else a measured matmul."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for fragment, flops in BF16_PEAK_FLOPS.items():
            if fragment in name:
                return flops, f"{name} bf16 datasheet"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = 2048 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    a @ a  # warm-up
    reps = 10
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ a
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - start) / reps
    return 2 * n**3 / seconds, f"measured {n}x{n} {str(dtype).removeprefix('torch.')} matmul on {device.type}"


class MetricsLog:
    """metrics.jsonl: one JSON object per line, appended (a resumed run continues the same file)."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path, self.enabled = path, enabled

    def write(self, **record) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def read_metrics(run_dir: str) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run_dir!r} has no metrics.jsonl (is it a pith-train run directory?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(run_dir: str, out: str | None = None) -> Path:
    """PNG of the training (and validation) loss and the throughput against step."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    # A resumed run re-logs steps after its checkpoint; the latest record of a step wins.
    by_step = {r["step"]: r for r in rows}
    steps = sorted(by_step)
    fig, (ax_loss, ax_tps) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax_loss.plot(steps, [by_step[s]["loss"] for s in steps], label="train")
    val = [s for s in steps if "val_loss" in by_step[s]]
    if val:
        ax_loss.plot(val, [by_step[s]["val_loss"] for s in val], "o-", label="validation")
    ax_loss.set_ylabel("loss")
    ax_loss.legend()
    ax_tps.plot(steps, [by_step[s]["tokens_per_s"] for s in steps])
    ax_tps.set_ylabel("tokens / s")
    ax_tps.set_xlabel("step")
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    path = Path(out) if out else Path(run_dir) / "metrics.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
