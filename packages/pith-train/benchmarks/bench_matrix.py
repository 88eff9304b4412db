"""Run `pith-train bench` on the reference workload under several settings, one process each (an
out-of-memory or compile failure costs only its own row), with the profile breakdown of the likeliest
winners (and of the fastest setting within the memory target if it had none), and print a table.

    python3 packages/pith-train/benchmarks/bench_matrix.py [OUT_DIR] [--budget SECONDS]

Rows run in order of interest and stop starting new ones once the time budget is spent; every
row's JSON is kept in OUT_DIR (default $OUT, else ./bench_matrix), the table goes to stdout and
OUT_DIR/table.txt.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MEMORY_TARGET_GIB = 60.0
PROFILE = "--profile=2"  # the likeliest winners profile two extra steps in the same process
# (name, bench arguments), most informative first: the eager baseline proves the path works, then
# compile with each recompute policy, then the eager policies and the other expert-GEMM kernel.
SETTINGS = [
    ("eager", ["--compile=off", "--ac=none"]),
    ("compile+sel", ["--compile=on", "--ac=selective", PROFILE]),
    ("compile", ["--compile=on", "--ac=none", PROFILE]),
    ("compile+full", ["--compile=on", "--ac=full"]),
    ("eager+sel", ["--compile=off", "--ac=selective"]),
    ("compile+sel+tritonGG", ["--compile=on", "--ac=selective", "--grouped-gemm=triton"]),
    ("eager+full", ["--compile=off", "--ac=full"]),
]


def bench(out: Path, name: str, args: list[str], timeout: float) -> dict | None:
    path = out / f"{name}.json"
    cmd = [sys.executable, "-m", "pith_train", "bench", *args, "--json", str(path)]
    print(f"--- {name}: {' '.join(args)}", flush=True)
    try:
        proc = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        print(f"    timed out after {timeout:.0f} s", flush=True)
        return None
    print(proc.stdout.strip(), flush=True)
    if proc.returncode:
        print(f"    failed (exit {proc.returncode}): ...{proc.stderr.strip()[-1500:]}", flush=True)
        return None
    return json.loads(path.read_text())


def row(name: str, r: dict | None) -> str:
    if r is None:
        return f"{name:<22} {'failed or skipped':>40}"
    return (
        f"{name:<22} {r['tokens_per_s']:>10,.0f} {r['step_ms']:>8.1f} {r['mfu_measured']:>7.1%}"
        f" {r['mfu_989']:>7.1%} {r['peak_allocated_gib'] or 0:>7.1f} {r['peak_reserved_gib'] or 0:>7.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default=os.environ.get("OUT", "bench_matrix"))
    parser.add_argument("--budget", type=float, default=270.0, help="seconds for the whole matrix")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    left = lambda: args.budget - (time.perf_counter() - start)
    results = {}
    for name, bench_args in SETTINGS:
        if left() < 40:
            print(f"--- {name}: skipped, {left():.0f} s of the budget left", flush=True)
            results[name] = None
            continue
        results[name] = bench(out, name, bench_args, timeout=min(180.0, left()))
    fits = {n: r for n, r in results.items() if r and (r["peak_reserved_gib"] or 0) <= MEMORY_TARGET_GIB}
    ran = fits or {n: r for n, r in results.items() if r}
    best = max(ran, key=lambda n: ran[n]["tokens_per_s"], default=None)
    if best is not None and "breakdown_ms_per_step" not in results[best] and left() > 40:
        results[f"{best} profiled"] = bench(out, "profile", [*dict(SETTINGS)[best], PROFILE], timeout=left())
    card = next((r["card"] for r in results.values() if r), "no result")
    lines = [
        f"card: {card}; workload: 4-layer Qwen3-30B-A3B, 4 x 4096 tokens/step, random tokens",
        f"{'setting':<22} {'tokens/s':>10} {'step ms':>8} {'MFU':>7} {'MFU989':>7}"
        f" {'alloc':>7} {'reserv':>7}  (MFU: causal / measured matmul; MFU989: TorchTitan's; GiB)",
        *[row(n, r) for n, r in results.items()],
        f"best within {MEMORY_TARGET_GIB:.0f} GiB reserved: {best}",
    ]
    for name, r in results.items():
        if r and "breakdown_ms_per_step" in r:
            parts = ", ".join(f"{c} {ms:.1f}" for c, ms in r["breakdown_ms_per_step"].items())
            lines.append(f"{name} kernel ms/step: {parts}")
    table = "\n".join(lines)
    print(table)
    (out / "table.txt").write_text(table + "\n")


if __name__ == "__main__":
    main()
