"""The optimizer phase of the pith-train bench workload (3.11B fp32 parameters in the model's own
shapes), each variant against the copy bandwidth measured in the same process (run on a CUDA machine):

    python3 packages/pith-train/benchmarks/bench_optimizer.py [--json out.json]

- before: clip_grad_norm_ below (the norm, then a read-write scaling of the gradients) and torch's
  fused AdamW: 4 + 8 + 28 = 40 bytes a parameter;
- torch's fused AdamW with grad_scale = 1 / coef (it divides and writes the gradient back): 4 + 32;
- pith: parallel.grad_norm, then pith_train.optim.AdamW (pith_ops.adamw_, coef read on the device):
  4 + 28 = 32 bytes a parameter, the floor for a norm that must finish before any update.
Also checks on the first 64M elements of the parameters that pith's update equals the before path
(max |difference| over max |parameter change|, after 3 steps).
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import pith_models
import torch
from pith_engine import parallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "pith-ops" / "benchmarks"))
from harness import ceilings  # noqa: E402
from pith_train.bench import WORKLOAD  # noqa: E402
from pith_train.optim import AdamW  # noqa: E402

MESH = parallel.Mesh(parallel.Layout(), torch.device("cuda"))
MAX_NORM, LR, WD = 1.0, 3e-4, 0.1


def timed(fn, reps: int = 5, warmup: int = 2) -> float:
    times = []
    for i in range(warmup + reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def make_params(shapes, seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator("cuda").manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, device="cuda", generator=g) * 0.02)
        p.grad = torch.randn(shape, device="cuda", generator=g) * 1e-3
        params.append(p)
    return params


def groups(params):
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": WD},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    ceil = ceilings()
    shapes = [p.shape for p in pith_models.build(WORKLOAD).parameters()]
    out = {"card": ceil["card"], "copy_GBps": ceil["copy_GBps"], "params": sum(s.numel() for s in shapes)}
    out["rows"] = time_paths(shapes, ceil["copy_GBps"])
    torch.cuda.empty_cache()
    out["max_diff_over_max_change"] = check_numerics()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


def clip_grad_norm_(params, max_norm: float) -> None:
    """The path pith's optimizer replaced: the norm, then the gradients scaled in place."""
    coef = parallel.clip_coef(parallel.grad_norm(params, MESH), max_norm)
    torch._foreach_mul_([p.grad for p in params], coef)


def time_paths(shapes, copy_GBps: float) -> dict:
    n = sum(s.numel() for s in shapes)
    params, rows_out = make_params(shapes, 0), {}
    before = torch.optim.AdamW(groups(params), lr=LR, fused=True)
    scaled = torch.optim.AdamW(groups(params), lr=LR, fused=True)
    pith = AdamW(groups(params), lr=LR)

    def before_step():
        clip_grad_norm_(params, MAX_NORM)
        before.step()

    def scaled_step():
        coef = parallel.clip_coef(parallel.grad_norm(params, MESH), MAX_NORM)
        scaled.grad_scale = 1 / coef.reshape(1)  # the GradScaler protocol of torch's fused optimizers
        scaled.step()

    def pith_step():
        pith.step(grad_scale=parallel.clip_coef(parallel.grad_norm(params, MESH), MAX_NORM).reshape(1))

    rows = {
        "grad norm alone": (lambda: parallel.grad_norm(params, MESH), 4),
        "clip scaling alone (foreach_mul_)": (lambda: torch._foreach_mul_([p.grad for p in params], 1.0), 8),
        "torch fused AdamW alone": (before.step, 28),
        "before: clip_grad_norm_ + torch fused AdamW": (before_step, 40),
        "torch fused AdamW, grad_scale = 1/coef": (scaled_step, 36),
        "pith: grad_norm + pith_ops.adamw_": (pith_step, 32),
    }
    for name, (fn, bytes_per) in rows.items():
        ms = timed(fn)
        gbps = bytes_per * n / ms / 1e6
        floor_ms = 32 * n / copy_GBps / 1e6  # what the phase must move, at copy bandwidth
        rows_out[name] = {"ms": ms, "bytes_per_param": bytes_per, "GBps": gbps}
        print(
            f"{name:<46} {ms:7.2f} ms  {bytes_per:2d} B/param  {gbps:6.0f} GB/s"
            f" ({gbps / copy_GBps:.0%} of copy; 32 B/param floor {floor_ms:.1f} ms"
            f" = {floor_ms / ms:.0%})",
            flush=True,
        )
    return rows_out


def check_numerics() -> float:
    # Numerics: the same parameters and gradients through both paths, 3 steps, max_norm binding.
    m = 64 * 2**20
    small = [torch.Size([m // 2, 2]), torch.Size([2048])]
    a, b = make_params(small, 1), make_params(small, 1)
    start = [p.detach().clone() for p in a]
    opt_a, opt_b = torch.optim.AdamW(groups(a), lr=LR, fused=True), AdamW(groups(b), lr=LR)
    for _ in range(3):
        for pa, pb in zip(a, b):
            pb.grad.copy_(pa.grad)
        clip_grad_norm_(a, 0.1)
        opt_a.step()
        opt_b.step(grad_scale=parallel.clip_coef(parallel.grad_norm(b, MESH), 0.1).reshape(1))
    diff = max((pa - pb).abs().max().item() for pa, pb in zip(a, b))
    change = max((pa - s).abs().max().item() for pa, s in zip(a, start))
    print(
        f"pith vs before, 3 steps: max |diff| {diff:.3g}, max |change| {change:.3g}",
        f"ratio {diff / change:.1e}",
    )
    return diff / change


if __name__ == "__main__":
    main()
