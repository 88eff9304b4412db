#!/usr/bin/env bash
# `pith-train bench` at several commits in one device call, for finding the commit that moved a figure.
# The device has no git, so it runs in two steps, from the repository root:
#   here:    bash packages/pith-train/benchmarks/bisect_bench.sh prepare COMMIT...
#            (git archive of each commit's packages/*/src into $DIR/<commit>, DIR default .bisect,
#            which .gitignore leaves out: name it in the device call's carry)
#   device:  bash packages/pith-train/benchmarks/bisect_bench.sh run [BENCH FLAGS...]
#            (each commit's bench with PYTHONPATH set to its own sources, in the order prepared;
#            ROUNDS=2 runs them again in reverse order, so drift over the call shows as a difference
#            between a commit's two figures)
# Default bench flags: the FP8 bench workload as a CUDA graph with a 2-step profile,
#   --compile on --ac none --cuda-graph --fp8 --fp8-lm-head --steps 6 --warmup 3 --profile 2
# One bench with compile and the graph takes ~60-90 s (the first longest: the compile caches are
# shared between commits), so 5 commits fit one 600 s call; a run past RUN_TIMEOUT (default 150 s) is
# stopped, and no run starts past BUDGET (default 570 s). It prints, per commit: tokens/s (median of the
# synced steps), back to back, the kernel time and device idle of the profiled steps, then the
# breakdowns side by side and each commit's longest idle gaps. Results: $OUT/bisect (else DIR/results).
set -u -o pipefail
cd "$(dirname "$0")/../../.."
mode="${1:-}"
shift || true
dir="${DIR:-.bisect}"
packages="pith-ops pith-engine pith-models pith-train"

if [ "$mode" = prepare ]; then
    [ $# -gt 0 ] || { echo "prepare: name the commits" >&2; exit 2; }
    rm -rf "$dir" && mkdir -p "$dir"
    for c in "$@"; do
        short=$(git rev-parse --short=7 "$c^{commit}") || exit 2
        mkdir -p "$dir/$short"
        paths=$(for p in $packages; do git cat-file -e "$short:packages/$p/src" && echo "packages/$p/src"; done)
        git archive "$short" $paths | tar -x -C "$dir/$short" || exit 1
        echo "$short $(git log -1 --format=%s "$short" | cut -c1-90)" >> "$dir/commits"
    done
    cat "$dir/commits"
    echo "prepared $(du -sh "$dir" | cut -f1) in $dir: carry [\"$dir\"] and run: bash $0 run"
    exit 0
fi
[ "$mode" = run ] || { sed -n 2,17p "$0"; exit 2; }
[ -f "$dir/commits" ] || { echo "no $dir/commits: run the prepare step here and carry $dir" >&2; exit 2; }
root=$(cd "$dir" && pwd)
flags=("$@")
[ ${#flags[@]} -gt 0 ] || flags=(--compile on --ac none --cuda-graph --fp8 --fp8-lm-head --steps 6 --warmup 3 --profile 2)
out="${OUT:-$dir/results}/bisect"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null || true
echo "bench ${flags[*]}"
mapfile -t commits < <(cut -d' ' -f1 "$dir/commits")
order=("${commits[@]}")
for ((r = 2; r <= ${ROUNDS:-1}; r++)); do
    for ((i = ${#commits[@]} - 1; i >= 0; i--)); do order+=("${commits[$i]}"); done
done
SECONDS=0
n=0
for c in "${order[@]}"; do
    if [ $((SECONDS + 90)) -gt "${BUDGET:-570}" ]; then echo "$c: not run (${SECONDS} s spent)"; continue; fi
    n=$((n + 1))
    src=$(for p in $packages; do printf '%s:' "$root/$c/packages/$p/src"; done)
    export PYTHONPATH="${src%:}"
    # The commit's own sources, not an installed copy: where python3 finds each package.
    from=$(python3 -c 'import importlib.util as u; print(*(u.find_spec(p).origin for p in
        ("pith_ops", "pith_engine", "pith_models", "pith_train")))')
    if [ "$(echo "$from" | tr ' ' '\n' | grep -vc "^$root/$c/")" != 0 ]; then
        echo "$c: not run: python3 imports $from, not $root/$c's"
        continue
    fi
    name="$out/$(printf %02d $n)_$c"
    start=$SECONDS
    timeout "${RUN_TIMEOUT:-150}" python3 -m pith_train bench "${flags[@]}" --json "$name.json" \
        > "$name.txt" 2>&1 || echo "$c: bench failed or timed out (rc $?): $name.txt"
    python3 - "$name.json" "$c" $((SECONDS - start)) <<'PY'
import json, sys
from pathlib import Path
p, c, s = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
if p.exists():
    r = json.loads(p.read_text())
    b2b = r.get("step_ms_back_to_back")
    b2b = f"{r['workload']['tokens_per_step'] / b2b * 1e3:,.0f}" if b2b else "-"
    kernel = sum(r.get("breakdown_ms_per_step", {}).values())
    idle = (r.get("idle") or {}).get("idle_ms_per_step", float("nan"))
    print(f"{c}: {r['tokens_per_s']:,.0f} tokens/s (step {r['step_ms']:.1f} ms), back to back {b2b};"
          f" profiled kernel time {kernel:.1f} ms, idle {idle:.2f} ms ({s} s)")
PY
done
python3 - "$out" "$dir/commits" <<'PY'
import json, sys
from pathlib import Path
runs = [(p.stem.split("_", 1)[1], json.loads(p.read_text())) for p in sorted(Path(sys.argv[1]).glob("*.json"))]
subjects = dict(line.rstrip("\n").split(" ", 1) for line in open(sys.argv[2]))
if not runs:
    sys.exit("no bench finished")
print(f"\n{runs[0][1]['card']}, torch {runs[0][1]['settings']['torch']}: tokens/s per commit (x the first run)")
base = runs[0][1]["tokens_per_s"]
for c, r in runs:
    print(f"  {c} {r['tokens_per_s']:>9,.0f}  x{r['tokens_per_s'] / base:.3f}  {subjects.get(c, '')[:70]}")
parts = [k for k in runs[0][1].get("breakdown_ms_per_step", {})]
if parts:
    print("\nbreakdown (ms/step of kernel time), one column per run:")
    print(f"  {'':<22}" + "".join(f"{c:>9}" for c, _ in runs))
    for k in parts:
        print(f"  {k:<22}" + "".join(f"{r['breakdown_ms_per_step'].get(k, 0):9.2f}" for _, r in runs))
    print(f"  {'device idle':<22}" + "".join(f"{(r.get('idle') or {}).get('idle_ms_per_step', 0):9.2f}" for _, r in runs))
for c, r in runs:
    gaps = (r.get("idle") or {}).get("longest", [])[:4]
    if gaps:
        print(f"{c} longest idle gaps: " + "; ".join(f"{g['us']:.0f} us {g['after'][:40]} -> {g['before'][:40]}" for g in gaps))
PY
