"""The loss table of fp8_vs_bf16.sh: `python3 fp8_loss_table.py RUNS SEED...` reads the run directories
RUNS/{bf16,fp8,bf16_v272,fp8lm_v272}_s{SEED} (300-step pretrain runs) and prints, per run, the mean
train loss of the last 20 steps and the final validation loss, then each FP8 configuration's mean over
the seeds against its BF16 twin's.

The tolerance comes from the BF16 runs alone. train.seed changes the weight init and the data order,
and a run's final loss moves by a seed-to-seed spread s (the BF16 runs' sample standard deviation,
pooled over the two vocabularies). If FP8 trained as BF16 does, the difference of two means over K
seeds would have standard deviation s * sqrt(2 / K); the tolerance is 3 of those. With K = 2 this is
2.1x the gap between the two BF16 seeds, where a bare two-seed gap is one draw of a quantity whose
typical size is 1.1 s and that lands under 0.25 s one time in seven.
"""

import json
import math
import statistics
import sys
from pathlib import Path

PAIRS = (("fp8", "bf16"), ("fp8lm_v272", "bf16_v272"))


def final_losses(run: Path) -> tuple[float, float]:
    """(mean train loss of the last 20 steps, final validation loss) of one run directory."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r["loss"] for r in rows if "loss" in r]
    return sum(train[-20:]) / len(train[-20:]), [r["val_loss"] for r in rows if "val_loss" in r][-1]


def main(root: Path, seeds: list[str]) -> bool:
    runs = {}
    for config in (c for pair in PAIRS for c in pair):
        for seed in seeds:
            run = root / f"{config}_s{seed}"
            if (run / "metrics.jsonl").exists():
                runs[config, seed] = final_losses(run)
                print(
                    f"{config:<11} seed {seed}: train (last 20) {runs[config, seed][0]:.4f}"
                    f"  validation {runs[config, seed][1]:.4f}"
                )
            else:
                print(f"{config:<11} seed {seed}: missing (see {run}.log)")
    ok = True
    for i, what in enumerate(("train (last 20)", "validation")):
        groups = [[runs[b, s][i] for s in seeds if (b, s) in runs] for _, b in PAIRS]
        dof = sum(len(g) - 1 for g in groups)
        if dof < 1:
            print(f"{what}: too few BF16 runs for a spread")
            return False
        s = math.sqrt(sum((len(g) - 1) * statistics.variance(g) for g in groups if len(g) > 1) / dof)
        for cand, base in PAIRS:
            both = [k for k in seeds if (cand, k) in runs and (base, k) in runs]  # paired seeds only
            if not both:
                ok = False
                continue
            c, b, k = [runs[cand, s][i] for s in both], [runs[base, s][i] for s in both], len(both)
            diff, tol = statistics.mean(c) - statistics.mean(b), 3 * s * math.sqrt(2 / k)
            ok &= abs(diff) <= tol
            print(
                f"{what}: {cand} mean {statistics.mean(c):.4f} - {base} mean {statistics.mean(b):.4f} ="
                f" {diff:+.4f} over {k} seeds; BF16 seed spread s = {s:.4f} ({dof} dof), tolerance"
                f" 3 s sqrt(2/{k}) = {tol:.4f}: {'PASS' if abs(diff) <= tol else 'FAIL'}"
            )
    return ok


if __name__ == "__main__":
    sys.exit(0 if main(Path(sys.argv[1]), sys.argv[2:]) else 1)
