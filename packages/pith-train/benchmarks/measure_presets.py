"""`pith-train plan --measure` on the 8-GPU presets of configs/: rank 0, the plan's heaviest rank and the
last rank of each, one after another on this one GPU (each in a fresh process: the mirrored process
group and the compiled stages are per process). A table of the measured peak allocated against the
plan, and the rank's step time without communication; JSON to OUT (default $OUT/measure_presets.json).

    python3 packages/pith-train/benchmarks/measure_presets.py [OUT.json] [--eager] [PRESET.toml:RANK ...]

Rows named PRESET.toml:RANK (a file in configs/) are measured alone, in that order.

Steps: one of warm-up (compilation), four timed (each printed; the table has the median). Each step's
host CPU time, allocator retries, new CUDA segments, Dynamo frames (compilations) and the (row, expert)
pairs its MoE layers' experts received are recorded beside it (against `even_pairs`, tokens x top-k of
a micro-batch): a step slower or larger in one process than in another shows which of these differ. Rows that
would start after 400 s are skipped and a row still running at 470 s is stopped (END_S=470 in the
environment), so the whole stays within 8 minutes: every preset's rank 0 first. A row that fails (out
of memory) is reported as such.
"""

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PRESETS = [
    "deepseek-v2-lite-8gpu.toml",
    "gpt-oss-20b-8gpu.toml",
    "qwen3-30b-a3b-8gpu.toml",
    "sft-qwen3-30b-a3b-8gpu.toml",
]
END_S = int(os.environ.get("END_S", 470))  # every row ends by END_S (a device call's time left)
BUDGET_S = END_S - 70  # and none starts after BUDGET_S


def one(config: str, rank: int, out: str, eager: bool) -> None:
    import torch
    from pith_engine.expert_parallel import ExpertParallel
    from pith_train import measure, plan
    from pith_train.config import load_config, model_config
    from torch._dynamo.utils import counters

    cfg = load_config(config, ["train.compile=false"] if eager else [])
    step, per_step, received, plan_of = measure.train_step, [], [], ExpertParallel.plan

    def recorded(self, counts):  # each MoE layer's exchange: what this rank's experts receive
        split = plan_of(self, counts)
        received.append(split.recv_pairs)
        return split

    ExpertParallel.plan = recorded

    def traced_step(*args):  # what each step did besides its kernels: where a slow step's time went
        stats, cpu, frames = torch.cuda.memory_stats(), time.process_time(), sum(counters["frames"].values())
        received.clear()
        result = step(*args)
        torch.cuda.synchronize()
        after = torch.cuda.memory_stats()
        per_step.append({
            "cpu_s": time.process_time() - cpu,
            "alloc_retries": after["num_alloc_retries"] - stats["num_alloc_retries"],
            "cuda_mallocs": after["segment.all.allocated"] - stats["segment.all.allocated"],
            "dynamo_frames": sum(counters["frames"].values()) - frames,
            # (row, local expert) pairs per MoE layer and micro-batch (forward and recompute): the
            # experts' load, against tokens x top-k for an even one
            "recv_pairs_max": max(received, default=0), "recv_pairs_sum": sum(received),
        })  # fmt: skip
        return result

    measure.train_step = traced_step
    r = measure.measure(cfg, rank, steps=4, warmup=1)
    stats = torch.cuda.memory_stats()
    print(measure.report(r), flush=True)
    m = plan.model_shape(model_config(cfg.model))
    row = {
        "config": Path(config).name, "rank": r["rank"], "heaviest": measure.heaviest(cfg, m, True),
        "pipeline_rank": r["plan"].rank, "moment": r["plan"].moment, "device": r["device"],
        "plan_gib": r["plan"].total / plan.GIB, "peak_allocated_gib": r["peak"] / plan.GIB,
        "terms_gib": {k: v / plan.GIB for k, v in r["plan"].terms.items()},
        "step_ms": statistics.median(r["steps_s"]) * 1e3, "steps_ms": [t * 1e3 for t in r["steps_s"]],
        "compile": cfg.train.compile, "per_step": per_step,
        "even_pairs": cfg.train.micro_batch * cfg.data.seq_len // cfg.parallel.cp * m.cfg.num_experts_per_tok,
        "reserved_peak_gib": stats["reserved_bytes.all.peak"] / plan.GIB,
        "alloc_retries": stats["num_alloc_retries"], "ooms": stats["num_ooms"],
        "held_gib": {k: sum(b for *_, b in v.values()) / plan.GIB for k, v in r["held"].items()},
    }  # fmt: skip
    Path(out).write_text(json.dumps(row))


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--eager" and ".toml:" not in a]
    chosen = [(a.split(":")[0], int(a.split(":")[1])) for a in sys.argv[1:] if ".toml:" in a]
    eager = "--eager" in sys.argv
    out = Path(args[0] if args else Path(os.environ.get("OUT", "."), "measure_presets.json"))
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    from pith_train import measure, plan
    from pith_train.config import load_config, model_config

    jobs = []  # (preset, rank): every preset's rank 0, then the heaviest and last ranks
    for name in PRESETS:
        cfg = load_config(str(ROOT / "configs" / name), [])
        p = cfg.parallel
        heavy = measure.heaviest(cfg, plan.model_shape(model_config(cfg.model)), True)
        jobs += [(name, r) for r in sorted({0, heavy, p.pp * p.dp * p.cp * p.ep - 1})]
    jobs.sort(key=lambda job: job[1] != 0)
    jobs = chosen or jobs
    out.parent.mkdir(parents=True, exist_ok=True)
    rows, start = [], time.monotonic()
    for name, rank in jobs:
        if time.monotonic() - start > BUDGET_S:
            rows.append({"config": name, "rank": rank, "error": f"skipped: the {END_S} s budget"})
            continue
        part = out.with_suffix(f".{name}.{rank}.json")
        cmd = [sys.executable, __file__, "--one", str(ROOT / "configs" / name), str(rank), str(part)]
        try:
            row_s = END_S - (time.monotonic() - start)
            done = subprocess.run(
                cmd + ["--eager"] * eager, env=env, timeout=row_s, capture_output=True, text=True
            )
            print(done.stdout[-3000:], done.stderr[-2000:] if done.returncode else "", flush=True)
            error = (
                None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["failed"])[-1][:300]
            )
        except subprocess.TimeoutExpired:
            error = f"timed out after {row_s:.0f} s (the {END_S} s budget)"
        rows.append(
            json.loads(part.read_text()) if error is None else {"config": name, "rank": rank, "error": error}
        )
    print(f"\n{'preset':<28}{'rank':>5}{'plan GiB':>10}{'peak GiB':>10}{'peak/plan':>11}{'reserved':>10}"
          f"{'retries':>8}{'step ms':>10}{'CPU s':>7}{'load':>6}  timed steps, ms")  # fmt: skip
    for r in rows:
        if "error" in r:
            print(f"{r['config']:<28}{r['rank']:>5}  {r['error']}")
        else:
            ratio, cpu = r["peak_allocated_gib"] / r["plan_gib"], [s["cpu_s"] for s in r["per_step"][1:]]
            steps = ", ".join(f"{t:.0f}" for t in r["steps_ms"])
            # the most (row, expert) pairs one MoE exchange gave this rank's experts, in even loads
            load = max(s["recv_pairs_max"] for s in r["per_step"]) / r["even_pairs"]
            print(f"{r['config']:<28}{r['rank']:>5}{r['plan_gib']:10.2f}{r['peak_allocated_gib']:10.2f}"
                  f"{ratio:11.3f}{r['reserved_peak_gib']:10.2f}{r['alloc_retries']:8}{r['step_ms']:10.1f}"
                  f"{statistics.median(cpu):7.2f}{load:6.2f}  {steps}")  # fmt: skip
    out.write_text(json.dumps({"rows": rows, "seconds": time.monotonic() - start}, indent=1))
    print(f"wrote {out} ({time.monotonic() - start:.0f} s)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        one(sys.argv[2], int(sys.argv[3]), sys.argv[4], "--eager" in sys.argv)
    else:
        main()
