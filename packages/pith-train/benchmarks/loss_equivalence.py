"""Does the optimised path compute the same function as the plain one? Loss over the first 200 steps
on fixed data (issue 7), at the workload's width with fewer layers and shorter sequences.

    python3 packages/pith-train/benchmarks/loss_equivalence.py [OUT_DIR] [--ac selective] [--steps 200]

Three runs of `pith-train bench` from the same initial weights over the same batches (the built-in
byte-level corpus, prepared once into OUT_DIR/data, read in the trainer's seeded order):
  plain      no compile, no activation checkpointing, the Triton grouped GEMM
  plain'     the same with torch's grouped GEMM: another correct kernel, another bf16 rounding order
  optimised  compile, the chosen recompute policy, torch's grouped GEMM (the throughput setting)
The tolerance is the bf16 noise measured in the same run: plain' differs from plain only by the
rounding of an equally correct kernel, so max|plain' - plain| over the steps is how far two correct
bf16 paths drift apart on this data. Noise from independent sources adds, so the optimised path
passes at max|optimised - plain| <= 3 x that floor, and never below one bf16 ulp of the loss
(2^-8 relative, the rounding a single bf16 value carries). A real difference in the function (a
wrong recompute, a dropped term) moves the loss by far more within a few steps.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from pith_train.prepare import prepare, stdlib_corpus

SHAPE = ["--layers=2", "--seq-len=1024", "--batch=4"]  # 4,096 tokens/step, full width (vocab 151,936)


def run(out: Path, name: str, args: list[str], data: Path, steps: int) -> list[float]:
    path = out / f"{name}.json"
    cmd = [sys.executable, "-m", "pith_train", "bench", *SHAPE, *args, f"--data={data}"]
    cmd += [f"--steps={steps}", "--warmup=0", f"--json={path}"]
    print(f"--- {name}: {' '.join(args)}", flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(path.read_text())["losses"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default=os.environ.get("OUT", "loss_equivalence"))
    parser.add_argument("--ac", default="selective", choices=["none", "selective", "full"])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    out = Path(args.out)
    data = out / "data"
    if not (data / "meta.json").is_file():
        prepare(stdlib_corpus(), str(data), "byte", progress=False)
    eager = ["--compile=off", "--ac=none"]
    plain = run(out, "plain", [*eager, "--grouped-gemm=triton"], data, args.steps)
    plain2 = run(out, "plain_torch_gg", [*eager, "--grouped-gemm=torch"], data, args.steps)
    opt = run(out, "optimised", ["--compile=on", f"--ac={args.ac}", "--grouped-gemm=torch"], data, args.steps)
    floor = max(abs(a - b) for a, b in zip(plain, plain2))
    diff = max(abs(a - b) for a, b in zip(plain, opt))
    ulp = 2**-8 * sum(plain) / len(plain)
    tol = max(3 * floor, ulp)
    for i in sorted({0, 1, 9, 49, 99, len(plain) - 1} & set(range(len(plain)))):
        print(f"step {i + 1:>4}: plain {plain[i]:.4f}  plain' {plain2[i]:.4f}  optimised {opt[i]:.4f}")
    print(
        f"max |plain' - plain| = {floor:.4f} (bf16 noise floor); max |optimised - plain| = {diff:.4f};"
        f" tolerance max(3 x floor, 2^-8 x mean loss {ulp:.4f}) = {tol:.4f}:"
        f" {'PASS' if diff <= tol else 'FAIL'}"
    )
    (out / "summary.json").write_text(
        json.dumps({"floor": floor, "max_diff": diff, "tolerance": tol, "pass": diff <= tol}, indent=1)
    )


if __name__ == "__main__":
    main()
