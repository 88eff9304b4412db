#!/usr/bin/env bash
# `pith-train bench --compare` of BF16 and of FP8 + FP8 lm_head against this card's records, from the
# repository root, one process each (~1-1.5 min each with compile and the CUDA graph); exit 1 when a
# figure is below 0.97 of its record or has none. RECORD=1 sets the records instead: the GPU machine
# has no git, so name the commit, and bring the files back through $OUT:
#   bash benchmarks/compare.sh
#   PITH_COMMIT=abc1234 RECORD=1 bash benchmarks/compare.sh && cp benchmarks/*.json "$OUT"/
# The bench's whole output: $OUT/compare-{bf16,fp8}.txt (or /tmp).
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=packages/pith-ops/src:packages/pith-engine/src:packages/pith-models/src:packages/pith-train/src
mode=--compare
[ "${RECORD:-0}" = 1 ] && mode=--record
status=0
for run in bf16 fp8; do
    flags=""
    [ $run = fp8 ] && flags="--fp8 --fp8-lm-head"
    log="${OUT:-/tmp}/compare-$run.txt"
    # shellcheck disable=SC2086
    python3 -m pith_train bench --compile on --ac none --cuda-graph --steps 6 --warmup 3 --profile 1 $flags \
        $mode --json "${OUT:-/tmp}/compare-$run.json" >"$log" 2>&1 || status=1
    echo "== $run: $(grep -m 1 "tokens/step" "$log")"
    grep -E "^  [0-9,]+ tokens/s|back to back" "$log"
    sed -n '/^wrote /,$p' "$log" | tail -n +2
    grep -q "^wrote " "$log" || tail -n 3 "$log"  # it stopped before measuring: why
done
exit $status
