"""Optimizer step time, Muon (+ AdamW on the rest) against AdamW, on the `pith-train bench` workload's
parameters (3.11B, fp32 master weights, random gradients), one GPU, one process.

    python packages/pith-train/benchmarks/bench_muon.py [--steps 10] [--warmup 3]

Each optimizer is built as the trainer builds it (pith_train.optim.build_optimizer) and timed alone:
median of `steps` device-synchronised steps after `warmup`; for Muon its two parts also separately.
"""

import argparse
import statistics
import time

import pith_models
import torch
from pith_train.bench import WORKLOAD
from pith_train.config import load_config
from pith_train.muon import NS_STEPS
from pith_train.optim import build_optimizer


def _median_ms(step, steps: int, warmup: int) -> float:
    times = []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    model = pith_models.build(WORKLOAD, "cuda", seed=0).float()
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    billions = sum(p.numel() for p in model.parameters()) / 1e9
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {billions:.2f}B parameters")
    results = {}
    for name in ("adamw", "muon"):
        opt = build_optimizer(model, load_config(None, [f"--optim.name={name}", "--train.lr=3e-4"]))
        torch.cuda.reset_peak_memory_stats()
        results[name] = _median_ms(opt.step, args.steps, args.warmup)
        peak = torch.cuda.max_memory_allocated() / 2**30
        print(f"{name}: optimizer step {results[name]:.1f} ms (median of {args.steps}), peak {peak:.1f} GiB")
        if name == "muon":
            adamw, muon = opt.optimizers
            mats = [p for g in muon.param_groups for p in g["params"]]
            # NS5 matmul FLOPs, per iteration of a wide m x n (m <= n): X X^T and B X 2m^2n each, A^2 2m^3.
            flops = sum(p.numel() // p.shape[-1] // p.shape[-2] * NS_STEPS * (4 * min(p.shape[-2:]) ** 2
                        * max(p.shape[-2:]) + 2 * min(p.shape[-2:]) ** 3) for p in mats)  # fmt: skip
            muon_ms = _median_ms(muon.step, args.steps, args.warmup)
            print(f"  Muon part: {muon_ms:.1f} ms over {sum(p.numel() for p in mats) / 1e9:.2f}B parameters,"
                  f" NS5 {flops / 1e12:.1f} TFLOP = {flops / muon_ms / 1e9:.0f} TFLOP/s")  # fmt: skip
            print(f"  AdamW part: {_median_ms(adamw.step, args.steps, args.warmup):.1f} ms")
        del opt
        torch.cuda.empty_cache()
    print(f"muon / adamw step time: {results['muon'] / results['adamw']:.2f}x")


if __name__ == "__main__":
    main()
