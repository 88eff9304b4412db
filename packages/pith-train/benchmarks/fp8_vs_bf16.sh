#!/usr/bin/env bash
# FP8 against BF16 on one GPU (issue 18), from the repository root:
#   bash packages/pith-train/benchmarks/fp8_vs_bf16.sh        # ~4 min on an H200
# 1. Loss: three 300-step runs of the default tiny MoE on the built-in corpus, side by side: BF16 with
#    train.seed 0 and 1 (weight init and data order; their gap is the tolerance) and FP8 with seed 0.
# 2. Throughput: `pith-train bench` on the reference workload, BF16 then FP8 (one process each, the
#    same settings), each with a profile breakdown.
# Results go to $OUT/fp8 when OUT is set, else ./bench_out/fp8. STEPS (300) and BENCH_ARGS (the bench
# settings, default "--steps 5 --warmup 3 --profile 2") override.
set -eu -o pipefail
cd "$(dirname "$0")/../../.."
export PYTHONPATH="packages/pith-ops/src:packages/pith-engine/src:packages/pith-models/src:packages/pith-train/src${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-bench_out}/fp8"
mkdir -p "$out"
steps="${STEPS:-300}"
bench_args="${BENCH_ARGS:---steps 5 --warmup 3 --profile 2}"
loss_run() {
    python3 -m pith_train pretrain --train.steps="$steps" --train.seed="$2" --train.fp8="$3" \
        --log.progress=false --run-dir "$out/$1" > "$out/$1.log" 2>&1
}
loss_run bf16_seed0 0 false & loss_run bf16_seed1 1 false & loss_run fp8_seed0 0 true &
wait || true  # a failed run shows in the summary; the benches still run
python3 - "$out" <<'PY' || echo "a loss run failed: see $out/*.log"
import json, sys
from pathlib import Path
rows = {}
for name in ("bf16_seed0", "bf16_seed1", "fp8_seed0"):
    m = [json.loads(line) for line in (Path(sys.argv[1]) / name / "metrics.jsonl").read_text().splitlines()]
    train = [r["loss"] for r in m if "loss" in r]
    rows[name] = (sum(train[-20:]) / len(train[-20:]), [r["val_loss"] for r in m if "val_loss" in r][-1], train[0])
    print(f"{name:<12} step-1 loss {rows[name][2]:.4f}  mean train loss of the last 20 steps {rows[name][0]:.4f}"
          f"  final validation loss {rows[name][1]:.4f}")
tol = [abs(a - b) for a, b in zip(rows["bf16_seed0"][:2], rows["bf16_seed1"][:2])]
gap = [abs(a - b) for a, b in zip(rows["fp8_seed0"][:2], rows["bf16_seed0"][:2])]
for what, t, g in zip(("last-20 train", "validation"), tol, gap):
    print(f"{what}: |fp8 - bf16| = {g:.4f}, tolerance |bf16 seed 0 - seed 1| = {t:.4f}: {'PASS' if g <= t else 'FAIL'}")
PY
for mode in bf16 fp8; do
    flag=""; [ "$mode" = fp8 ] && flag="--fp8"
    python3 -m pith_train bench $bench_args $flag --json "$out/bench_$mode.json" 2>&1 \
        | tee "$out/bench_$mode.txt"
done
python3 - "$out" <<'PY'
import json, sys
b, f = (json.load(open(f"{sys.argv[1]}/bench_{m}.json")) for m in ("bf16", "fp8"))
print(f"{f['card']}: FP8 {f['tokens_per_s']:,.0f} tokens/s vs BF16 {b['tokens_per_s']:,.0f}: x{f['tokens_per_s'] / b['tokens_per_s']:.3f};"
      f" peak allocated {f['peak_allocated_gib']:.1f} vs {b['peak_allocated_gib']:.1f} GiB")
PY
