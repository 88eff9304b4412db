#!/usr/bin/env bash
# FP8 quantisation kernels on one GPU (issue 18), from the repository root:
#   bash packages/pith-ops/benchmarks/fp8_quant_gpu.sh        # ~2 min on an H200
# 1. The gpu-marked tests of tests/test_fp8_quant.py (bit-exact against the references at real tiles)
#    and of tests/test_fp8_gemms.py (the FP8 GEMMs through these kernels).
# 2. bench_fp8_quant.py at the `pith-train bench --fp8` shapes and the tile sweep, with the kernels
#    before this rewrite timed in the same process from $BASELINE (default build/fp8_quant_main.py,
#    written here by `git show c185f33:packages/pith-ops/src/pith_ops/fp8_quant.py` when git can;
#    without git, write it beforehand and carry it).
set -eu -o pipefail
cd "$(dirname "$0")/../../.."
export PYTHONPATH="packages/pith-ops/src:packages/pith-engine/src:packages/pith-models/src:packages/pith-train/src:packages/ate-bench/src${PYTHONPATH:+:$PYTHONPATH}"
baseline="${BASELINE:-build/fp8_quant_main.py}"
if [ ! -f "$baseline" ]; then
    mkdir -p "$(dirname "$baseline")"
    git show c185f33:packages/pith-ops/src/pith_ops/fp8_quant.py > "$baseline" 2>/dev/null || rm -f "$baseline"
fi
status=0
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider packages/pith-ops/tests/test_fp8_quant.py \
    packages/pith-ops/tests/test_fp8_gemms.py || status=$?
args=(--sweep)
[ -f "$baseline" ] && args+=(--baseline "$baseline") || echo "no baseline at $baseline: new kernels only"
timeout 200 python3 packages/pith-ops/benchmarks/bench_fp8_quant.py "${args[@]}" || status=$?
exit "$status"
