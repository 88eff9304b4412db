#!/usr/bin/env bash
# The kept bf16 weight casts' speed and the optimised path's loss equivalence on one GPU, from the
# repository root (~6 min on an H200; results in $OUT, else ./bench_out):
# 1. `pith-train bench --compile on --ac none --steps 6 --warmup 3` without and with the kept bf16
#    weight casts in one process, the second with `--profile 2` (kept_casts.py, ~2.5 min);
# 2. the 200-step loss equivalence, optimised (compile, no recompute) against the plain noise family
#    (loss_equivalence.py, ~3.5 min).
set -u
cd "$(dirname "$0")/../../.."
export PYTHONPATH="packages/pith-ops/src:packages/pith-engine/src:packages/pith-models/src:packages/pith-train/src${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-bench_out}"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true
SECONDS=0
python3 packages/pith-train/benchmarks/kept_casts.py "$out/kept_casts"
echo "--- bench: ${SECONDS} s"
python3 packages/pith-train/benchmarks/loss_equivalence.py "$out/equivalence" --ac none
echo "--- total: ${SECONDS} s"
