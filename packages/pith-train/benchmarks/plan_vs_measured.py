"""`pith-train plan` against the allocator's peaks on a card: the bench's workload (pith_train.bench.run,
the trainer's own step) in several configurations, one table row each: the planned total, the measured
peak allocated and reserved (torch.cuda.max_memory_allocated / reserved over the timed steps), and the
ratios; then each row's planned terms, so a term that is off can be told apart and its constant in
pith_train/plan.py corrected. One process, the rows one after another (~3-4 min on an H100):

    python3 packages/pith-train/benchmarks/plan_vs_measured.py [OUT.json]

The first row is the bench preset (configs/bench-qwen3-4layers-1gpu.toml, compiled, as the README's
52.1 GiB); the others are 2 layers of the same geometry, 2 x 4096 tokens, eager (compilation would
take most of the budget; eager keeps the same tensors but the attention stage's, which the compiled
graph may save fewer of): BF16 under each recompute policy, FP8 with the FP8 lm_head, two
micro-batches (two in flight: F(1) runs before B(0)), and the step as a CUDA graph (its pool).
"""

import gc
import json
import sys

import torch
from pith_train import bench

ROWS = {  # name -> bench.run arguments
    "bench preset (4 layers, 4x4096, compiled)": dict(compile=True),
    "BF16, ac none": dict(layers=2, batch=2, compile=False),
    "BF16, ac selective": dict(layers=2, batch=2, compile=False, ac="selective"),
    "BF16, ac full": dict(layers=2, batch=2, compile=False, ac="full"),
    "FP8 + FP8 lm_head, ac none": dict(layers=2, batch=2, compile=False, fp8=True, fp8_lm_head=True),
    "BF16, 2 micro-batches": dict(layers=2, batch=2, compile=False, micro_batch=1),
    "BF16, CUDA graph": dict(layers=2, batch=2, compile=False, cuda_graph=True),
}


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("plan_vs_measured.py measures a CUDA card's allocator: run it on a GPU")
    results = {}
    print(f"{torch.cuda.get_device_name()}; GiB")
    print(f"{'configuration':<44}{'before':>7}{'plan':>7}{'allocated':>11}{'reserved':>10}{'plan/alloc':>12}"
          f"{'plan/res':>10}")  # fmt: skip
    for name, args in ROWS.items():
        before = torch.cuda.memory_allocated() / 2**30  # left by the rows before (should be ~0)
        r = bench.run(steps=2, warmup=2, back_to_back=False, **args)
        plan, alloc, res = r["plan_gib"]["total"], r["peak_allocated_gib"], r["peak_reserved_gib"]
        ratios = f"{plan / alloc:12.3f}{plan / res:10.3f}"
        print(f"{name:<44}{before:7.2f}{plan:7.2f}{alloc:11.2f}{res:10.2f}{ratios}", flush=True)
        results[name] = {"args": args, "plan_gib": r["plan_gib"], "allocated_gib": alloc, "reserved_gib": res}
        del r
        torch._dynamo.reset()  # compiled graphs keep their modules alive
        gc.collect()
        torch.cuda.empty_cache()
    print("\nplanned terms (GiB), at the start of the backward unless the optimizer step is larger:")
    for name, row in results.items():
        terms = ", ".join(f"{k} {v:.2f}" for k, v in row["plan_gib"].items() if k != "total" and v)
        print(f"  {name}: {terms}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"card": torch.cuda.get_device_name(), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
