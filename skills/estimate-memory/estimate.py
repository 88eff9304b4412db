"""estimate-memory: memory per GPU of training a model under a parallel layout, by `pith-train plan`
(pith_train.plan, its docstring has the terms and their formulas): the model is built on the meta
device, nothing is allocated. PASS if the plan fits a card of --gib GiB (the plan adds the allocator's
slack and the CUDA context itself).

Shape legend: none (the plan's are in pith_train/plan.py).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # skills/, for _common
import _common  # noqa: E402
from pith_train import plan  # noqa: E402
from pith_train.config import load_config  # noqa: E402


def main(argv: list[str] | None) -> tuple[bool, str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _common.add_model_args(parser, batch=(1, 4096))
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="bf16: CUDA; fp32: CPU")
    parser.add_argument("--ac", default="none", choices=["none", "selective", "full"], help="train.ac")
    parser.add_argument("--fp8", action="store_true", help="train.fp8")
    for axis in ("pp", "dp", "ep", "cp"):
        parser.add_argument(f"--{axis}", type=int, default=1, help=f"{axis} ranks")
    parser.add_argument("--gib", type=float, required=True, help="memory of one card, GiB")
    args = parser.parse_args(argv)
    m = plan.model_shape(_common.model_cfg(args))  # meta device
    # One micro-batch per data rank (2*pp under pipeline parallelism: DualPipeV's least).
    per_step = args.micro_batch * args.dp * args.ep * (2 * args.pp if args.pp > 1 else 1)
    cfg = load_config(None, [
        f"model.name={args.model}", f"data.seq_len={args.seq_len}", f"train.micro_batch={args.micro_batch}",
        f"train.global_batch={per_step}", f"train.ac={args.ac}", f"train.fp8={str(args.fp8).lower()}",
        f"parallel.pp={args.pp}", f"parallel.dp={args.dp}", f"parallel.ep={args.ep}",
        f"parallel.cp={args.cp}",
    ])  # fmt: skip
    plan.valid(cfg, m)  # experts over ep, sequence over 2*cp, layers over 2*pp chunks
    cuda = args.dtype == "bf16"
    out = plan.plan(cfg, m, cuda, args.gib * plan.GIB)
    fixes = [] if out.fits else plan.changes(cfg, m, cuda, out.capacity)
    print(plan.report(cfg, m, out, f"--gib {args.gib:g}", fixes))
    print(f"  {'total per GPU (needs)':<28}{out.needs / plan.GIB:9.3f}")
    sign = "<=" if out.fits else ">"
    return out.fits, f"{out.needs / plan.GIB:.3f} GiB per GPU {sign} budget {args.gib:g} GiB"


if __name__ == "__main__":
    _common.verdict(main)
