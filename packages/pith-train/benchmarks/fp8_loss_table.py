"""The loss table of fp8_vs_bf16.sh: `python3 fp8_loss_table.py RUNS STEPS SEED...` reads the run
directories RUNS/{bf16,fp8,bf16_v272,fp8lm_v272}_s{SEED} (STEPS-step pretrain runs; one that stopped
short counts as missing) and prints, per run, the mean train loss of the last 20 steps and the final
validation loss, then each FP8 configuration's mean over the seeds against its BF16 twin's.

The tolerance comes from the BF16 runs alone. train.seed changes the weight init and the data order,
and a run's final loss moves by a seed-to-seed spread s (the BF16 runs' sample standard deviation,
pooled over the two vocabularies). If FP8 trained as BF16 does, the difference of two means over K
seeds would have standard deviation s * sqrt(2 / K); the tolerance is 3 of those. With K = 2 this is
2.1x the gap between the two BF16 seeds, where a bare two-seed gap is one draw of a quantity whose
typical size is 1.1 s and that lands under 0.25 s one time in seven. The check is loose on purpose:
runs of one seed share the init and the data order, so their difference spreads less than that of
independent runs (printed too: the standard error of the paired differences), and s comes from few
runs.
"""

import json
import math
import statistics
import sys
from pathlib import Path

PAIRS = (("fp8", "bf16"), ("fp8lm_v272", "bf16_v272"))


def final_losses(run: Path, steps: int) -> tuple[float, float] | None:
    """(mean train loss of the last 20 steps, validation loss at the last step) of one run directory,
    or None when it did not reach step `steps` (stopped by a timeout, or failed)."""
    path = run / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    last = rows[-1] if rows else {}
    if last.get("step") != steps or last.get("val_loss") is None:
        return None
    train = [r["loss"] for r in rows if "loss" in r][-20:]
    return sum(train) / len(train), last["val_loss"]


def main(root: Path, steps: int, seeds: list[str]) -> bool:
    runs = {}
    for config in (c for pair in PAIRS for c in pair):
        for seed in seeds:
            got = final_losses(root / f"{config}_s{seed}", steps)
            if got is None:
                print(f"{config:<11} seed {seed}: did not reach step {steps} ({root}/{config}_s{seed}.log)")
                continue
            runs[config, seed] = got
            print(
                f"{config:<11} seed {seed}: {steps} steps, train (last 20) {got[0]:.4f},"
                f" validation {got[1]:.4f}"
            )
    ok = len(runs) == 2 * len(PAIRS) * len(seeds)  # a missing run fails the table
    for i, what in enumerate(("train (last 20)", "validation")):
        groups = [[runs[b, seed][i] for seed in seeds if (b, seed) in runs] for _, b in PAIRS]
        dof = sum(max(len(g) - 1, 0) for g in groups)
        if dof < 1:
            print(f"{what}: too few BF16 runs for a spread")
            return False
        s = math.sqrt(sum((len(g) - 1) * statistics.variance(g) for g in groups if len(g) > 1) / dof)
        for cand, base in PAIRS:
            both = [seed for seed in seeds if (cand, seed) in runs and (base, seed) in runs]
            ok &= bool(both)
            if not both:
                continue
            pairs = [runs[cand, seed][i] - runs[base, seed][i] for seed in both]
            k, diff, tol = len(both), statistics.mean(pairs), 3 * s * math.sqrt(2 / len(both))
            ok &= abs(diff) <= tol
            se = statistics.stdev(pairs) / math.sqrt(k) if k > 1 else math.nan
            print(
                f"{what}: {cand} - {base} = {diff:+.4f} (mean over {k} seeds); BF16 seed spread s = {s:.4f}"
                f" ({dof} dof), tolerance 3 s sqrt(2/{k}) = {tol:.4f}:"
                f" {'PASS' if abs(diff) <= tol else 'FAIL'},"
                f" the paired differences' standard error {se:.4f}"
            )
    return ok


if __name__ == "__main__":
    sys.exit(0 if main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]) else 1)
