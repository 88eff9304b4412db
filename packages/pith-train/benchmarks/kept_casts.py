"""`pith-train bench` with and without the kept bf16 weight casts (pith_ops.cast, rewritten by AdamW),
in one process, the same settings for both:

    python3 packages/pith-train/benchmarks/kept_casts.py [OUT_DIR] [--steps 6 --warmup 3 --profile 2]

Off first (the previous path: a cast of every expert and lm_head weight per use), then on, which is
also profiled (the breakdown, the kernel list and the device idle time). The warm-up steps absorb the
compilation (the second run finds its graphs cached). Results as JSON in OUT_DIR.
"""

import argparse
import gc
import json
import os
from pathlib import Path

import pith_ops._common
import torch
from pith_train import bench


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default=os.environ.get("OUT", "kept_casts"))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile", type=int, default=2)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokens = {}
    for keep in (False, True):
        pith_ops._common.KEEP_COPIES = keep
        r = bench.run(compile=True, ac="none", steps=args.steps, warmup=args.warmup,
                      profile_steps=args.profile if keep else 0)  # fmt: skip
        name = f"kept_casts_{'on' if keep else 'off'}"
        (out / f"{name}.json").write_text(json.dumps(r, indent=1))
        print(f"=== {name}\n{bench.summary(r)}", flush=True)
        tokens[name] = r["tokens_per_s"]
        gc.collect()
        torch.cuda.empty_cache()  # the next run's reserved peak starts from its own allocations
    on, off = tokens["kept_casts_on"], tokens["kept_casts_off"]
    print(f"kept casts: {off:,.0f} -> {on:,.0f} tokens/s ({on / off:.3f}x)")


if __name__ == "__main__":
    main()
