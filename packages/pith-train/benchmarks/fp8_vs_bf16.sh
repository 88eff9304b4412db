#!/usr/bin/env bash
# FP8 against BF16 on one GPU, and the BF16 path's loss equivalence, from the repository root, in one
# device call (~9 min on an H200; each phase time-boxed):
#   bash packages/pith-train/benchmarks/fp8_vs_bf16.sh
# 1. Alone on the GPU, for clean timing: `pith-train bench` on the reference workload, BF16, FP8 with
#    the FP8 lm_head, FP8 without it (one process each, the same settings: the step as a CUDA graph,
#    which the FP8 step needs to outrun its host; BENCH_ARGS overrides), each with a profile breakdown
#    and what is live at its memory peak (--memory-peak, recorded over the warm-up steps).
# 2. Then at the same time (TESTS=0 skips the first two): the gpu-marked tests of the FP8 operators,
#    AdamW, the fused loss and the CUDA-graph step; loss_equivalence.py --ac none (the
#    optimised BF16 path against the plain noise family); and 300-step runs of the default tiny MoE on
#    the built-in corpus, one per seed in SEEDS (train.seed: weight init and data order) of BF16 and
#    FP8, and with the vocabulary padded to 272 (FP8 GEMMs take multiples of 16) of BF16 and FP8 + FP8
#    lm_head. The summary compares each FP8 mean over the seeds with its BF16 twin's mean.
# MODES picks the benches (default "bf16 fp8lm fp8"). Results go to $OUT when set, else ./bench_out/fp8; the summaries go to stdout.
set -u -o pipefail
cd "$(dirname "$0")/../../.."
export PYTHONPATH="packages/pith-ops/src:packages/pith-engine/src:packages/pith-models/src:packages/pith-train/src:packages/ate-bench/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
out="${OUT:-bench_out/fp8}"
runs="$(mktemp -d)"
mkdir -p "$out"
steps="${STEPS:-300}"
seeds="${SEEDS:-0 1 2 3}"
bench_args="${BENCH_ARGS:---steps 6 --warmup 3 --profile 1 --cuda-graph --memory-peak}"
start=$SECONDS
for mode in ${MODES:-bf16 fp8lm fp8}; do  # MODES: a subset, BF16 first
    flags=""; [ "$mode" = fp8 ] && flags="--fp8"; [ "$mode" = fp8lm ] && flags="--fp8 --fp8-lm-head"
    timeout 100 python3 -m pith_train bench $bench_args $flags --json "$runs/bench_$mode.json" \
        > "$out/bench_$mode.txt" 2>&1 || echo "bench $mode failed or timed out (rc $?)"
    grep -E "tokens/s|peak memory|back to back|allocation peak|GiB +[0-9]+ blocks" "$out/bench_$mode.txt"
done
python3 - "$runs" <<'PY' || echo "a bench failed: see $out/bench_*.txt"
import json, sys
from pathlib import Path
load = lambda m: json.load(open(p)) if (p := Path(sys.argv[1]) / f"bench_{m}.json").exists() else {}
b, l, f = (load(m) for m in ("bf16", "fp8lm", "fp8"))
for name, r in (("FP8 + FP8 lm_head", l), ("FP8", f)):
    if not r:
        continue
    print(f"{r['card']}: {name} {r['tokens_per_s']:,.0f} tokens/s vs BF16 {b['tokens_per_s']:,.0f}: x{r['tokens_per_s'] / b['tokens_per_s']:.3f};"
          f" peak allocated {r['peak_allocated_gib']:.1f} vs {b['peak_allocated_gib']:.1f} GiB, reserved {r['peak_reserved_gib']:.1f} vs {b['peak_reserved_gib']:.1f}")
rows = [(n, r) for n, r in (("bf16", b), ("fp8+lm_head", l), ("fp8", f)) if r]
for c in b.get("breakdown_ms_per_step", {}):
    print(f"  {c:<22} " + "  ".join(f"{n} {r['breakdown_ms_per_step'].get(c, 0):7.2f}" for n, r in rows) + " ms")
print("  device idle in profiled steps: " + ", ".join(f"{n} {r['idle']['idle_ms_per_step']:.2f}" for n, r in rows))
PY
echo "== benches done at $((SECONDS - start)) s"
loss_run() {  # name, then pretrain overrides
    local name=$1; shift
    timeout "$loss_timeout" python3 -m pith_train pretrain --train.steps="$steps" --log.progress=false "$@" \
        --run-dir "$runs/$name" > "$runs/$name.log" 2>&1 || echo "loss run $name failed or timed out (rc $?)"
}
# The loss runs end before the device's 600 s a call (with 30 s for the table), LOSS_TIMEOUT at most.
loss_timeout=$((570 - (SECONDS - start)))
[ "$loss_timeout" -gt "${LOSS_TIMEOUT:-360}" ] && loss_timeout=${LOSS_TIMEOUT:-360}
echo "== loss runs: $loss_timeout s at most"
if [ "${TESTS:-1}" != 0 ]; then
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider packages/pith-ops/tests/test_fp8_quant.py \
        packages/pith-ops/tests/test_fp8_gemms.py packages/pith-ops/tests/test_adamw.py \
        packages/pith-ops/tests/test_swiglu.py packages/pith-ops/tests/test_cross_entropy.py \
        packages/pith-ops/tests/test_moe_permute.py \
        packages/pith-train/tests/test_step.py > "$out/tests.txt" 2>&1 &
    timeout 290 python3 packages/pith-train/benchmarks/loss_equivalence.py "$runs/equivalence" --ac none \
        > "$out/equivalence.txt" 2>&1 &
fi
for seed in $seeds; do
    loss_run "bf16_s$seed" --train.seed="$seed" &
    loss_run "fp8_s$seed" --train.seed="$seed" --train.fp8=true &
    loss_run "bf16_v272_s$seed" --train.seed="$seed" --model.vocab_size=272 &
    loss_run "fp8lm_v272_s$seed" --train.seed="$seed" --model.vocab_size=272 --train.fp8=true --train.fp8_lm_head=true &
done
wait
if [ "${TESTS:-1}" != 0 ]; then
    echo "== gpu-marked tests"; grep -E "passed|failed|^FAILED" "$out/tests.txt"
    echo "== loss equivalence"; tail -n 12 "$out/equivalence.txt"
fi
python3 packages/pith-train/benchmarks/fp8_loss_table.py "$runs" "$steps" $seeds 2>&1 | tee "$out/loss.txt" \
    || echo "the loss table has a FAIL or missing runs (above)"
echo "== done at $((SECONDS - start)) s"
