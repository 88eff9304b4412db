#!/usr/bin/env bash
# Single-GPU throughput of the bench workload, from the repository root:
#   bash packages/pith-train/benchmarks/bench_matrix.sh              # settings matrix + profile of the best (~5 min)
#   bash packages/pith-train/benchmarks/bench_matrix.sh equivalence  # optimised vs plain family, 200 steps (~3.5 min)
# Results (JSON per run, table.txt / summary.json) go to $OUT when set, else ./bench_out.
set -u
cd "$(dirname "$0")/../../.."
export PYTHONPATH="packages/pith-ops/src:packages/pith-engine/src:packages/pith-models/src:packages/pith-train/src${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-bench_out}"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true
if [ "${1:-matrix}" = equivalence ]; then
    exec python3 packages/pith-train/benchmarks/loss_equivalence.py "$out/equivalence" "${@:2}"
fi
exec python3 packages/pith-train/benchmarks/bench_matrix.py "$out/matrix" "${@:2}"
