"""Mutation check of the path-walking tests (test_hf_oracle.py, test_config_space.py): each mutant is
a one-line scale bug (a loss, gradient or metric scaled by, or not reduced over, the micro-batches,
data, expert, pipeline or context ranks), applied alone to a scratch copy of the working tree; the
tests run there and must fail. Prints the table mutant -> caught (the first failing test) / survived.

    uv run python packages/pith-train/benchmarks/mutants.py [NAME ...] [--baseline]

A mutant only multiple processes can show runs the config-space test's multi-process draw alone,
its layouts pinned (CONFIG_SPACE_LAYOUTS) to one with the axis it breaks (and, where one numerics'
tolerance would hide the bug, its options to another: CONFIG_SPACE_OPTIONS); a micro-batch mutant
runs the transformers oracle, then the one-process draws (a bias mutant those alone, pinned to the bias
update on and load balancing off, CONFIG_SPACE_OPTIONS: the oracle has no bias, and only then may
the plain run merge the micro-batches). Slow (each mutant trains the draws: about a minute to
several on 2 cores), so not part of the suite. --baseline runs the unmutated copy first.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[3]
TESTS = "packages/pith-train/tests/"
ORACLE = TESTS + "test_hf_oracle.py"
SPACE = TESTS + "test_config_space.py::test_"
ONE = SPACE + "one_process_configs_train_like_the_plain_run_and_resume_bit_for_bit"
MULTI = SPACE + "layouts_of_2_and_4_processes_train_like_the_plain_run_and_resume_bit_for_bit"
STEP, PARALLEL = (
    "packages/pith-engine/src/pith_engine/step.py",
    "packages/pith-engine/src/pith_engine/parallel.py",
)
TRAIN, EXPERTS = (
    "packages/pith-train/src/pith_train/train.py",
    "packages/pith-engine/src/pith_engine/expert_parallel.py",
)
# Layouts (pp,dp,cp,ep) the multi-process draw is pinned to, by the axis a mutant breaks.
DATA, CP, PP, EP = "1,2,1,1", "1,1,2,1", "2,1,1,1", "1,1,1,2"
# The one-process draws pinned to a bias update with micro-batches merged in the plain run.
BIAS = "--train.lbl_coef=0.0 --train.bias_rate=1e-2"
# No FP8 anywhere (fp8_lm_head is drawn under fp8 but works alone): the fp32 tolerances apply.
FP32 = "--train.fp8=false --train.fp8_lm_head=false --train.fp8_all_gather=false"


NO_SHRINK = """
from hypothesis import Phase  # noqa: E402
settings.register_profile("mutants", settings.get_profile("ci"), phases=[Phase.explicit, Phase.generate])
settings.load_profile("mutants")
"""


class Mutant(NamedTuple):
    name: str
    what: str
    path: str
    old: str
    new: str
    layouts: str = ""  # CONFIG_SPACE_LAYOUTS: run MULTI alone (else the oracle, then ONE)
    options: str = ""  # CONFIG_SPACE_OPTIONS (without layouts: run ONE alone)

    @property
    def tests(self) -> tuple[str, ...]:
        return (MULTI,) if self.layouts else (ONE,) if self.options else (ORACLE, ONE)


MUTANTS = [
    Mutant(
        "ce_grad_x_micro", "cross-entropy gradient x micro-batches", STEP,
        "return ce.float() / self.label_tokens, ce.detach().float()",
        "return ce.float() / self.label_tokens * len(self.micro), ce.detach().float()",
    ),
    Mutant(
        "ce_tokens_not_over_data", "cross-entropy over this rank's label tokens (x data ranks)", STEP,
        "label_tokens = parallel.all_reduce_sum(sum((y != IGNORE_INDEX).sum() for _, y, _ in micro), mesh)",
        "label_tokens = sum((y != IGNORE_INDEX).sum() for _, y, _ in micro)", DATA,
    ),
    Mutant(
        "ce_tokens_over_pp", "cross-entropy label tokens summed over pipeline ranks too (/ pp)", STEP,
        "for _, y, _ in micro), mesh)", "for _, y, _ in micro), mesh, True)", PP,
    ),
    Mutant(
        "loss_aux_metric_not_over_pp", "the step's loss and aux sums not summed over pipeline ranks", STEP,
        "return parallel.all_reduce_sum(run.sums[:2].clone(), mesh, pp=True), run.counts, label_tokens",
        "return parallel.all_reduce_sum(run.sums[:2].clone(), mesh), run.counts, label_tokens", PP,
    ),
    Mutant(
        "aux_not_over_micro", "aux losses not divided by the micro-batch count", STEP,
        "/ aux.moe_layers / aux.micro_batches, counts_E", "/ aux.moe_layers, counts_E",
    ),
    Mutant(
        "aux_tokens_not_over_data", "aux losses' token count without the data ranks", STEP,
        "self.tokens = ids_BS.numel() * stages.mesh.layout.data_ranks * stages.mesh.layout.cp",
        "self.tokens = ids_BS.numel() * stages.mesh.layout.cp", DATA,
    ),
    Mutant(
        "aux_tokens_not_over_cp", "aux losses' token count without the context ranks", STEP,
        "self.tokens = ids_BS.numel() * stages.mesh.layout.data_ranks * stages.mesh.layout.cp",
        "self.tokens = ids_BS.numel() * stages.mesh.layout.data_ranks", CP,
    ),
    Mutant(
        "lbl_probs_local_mean", "load balancing: router probabilities averaged over this rank's tokens", STEP,
        "r.probs_TE.sum(0) / tokens).sum()", "r.probs_TE.mean(0)).sum()", DATA,
    ),
    Mutant(
        "z_loss_local_mean", "z-loss averaged over this rank's tokens (x context ranks)", STEP,
        "** 2).sum() / tokens", "** 2).mean()", CP,
    ),
    Mutant(
        "counts_not_over_data", "expert counts not summed over data ranks (load balancing, bias)", STEP,
        "    parallel.all_reduce_sum(counts_E, mesh)\n", "", DATA,
    ),
    Mutant(
        "bias_counts_last_micro", "bias update from the last micro-batch's expert counts", STEP,
        "self.counts[i] = self.counts.get(i, 0) + counts_E", "self.counts[i] = counts_E", options=BIAS,
    ),
    Mutant(
        "bias_rate_x_micro", "bias update x micro-batches", STEP,
        "update_expert_bias(stages.biases, counts, finite * bias_rate)",
        "update_expert_bias(stages.biases, counts, finite * bias_rate * len(micro))", options=BIAS,
    ),
    Mutant(
        "val_tokens_last_micro", "validation loss over the last micro-batch's label tokens", STEP,
        "self.sums[2] += (labels_BS != IGNORE_INDEX).sum()",
        "self.sums[2] = (labels_BS != IGNORE_INDEX).sum()",
    ),
    Mutant(
        "val_not_over_data", "validation loss not summed over data ranks", STEP,
        "total = parallel.all_reduce_sum(run.sums[[0, 2]].clone(), mesh, pp=True)",
        "total = run.sums[[0, 2]].clone()", DATA,
    ),
    Mutant(
        "norm_not_over_ranks", "gradient norm of this rank's shards only", PARALLEL,
        "return all_reduce_sum(sq, mesh, pp=True).sqrt()", "return sq.sqrt()", DATA,
    ),
    Mutant(
        "norm_not_over_pp", "gradient norm not summed over pipeline ranks", PARALLEL,
        "return all_reduce_sum(sq, mesh, pp=True).sqrt()", "return all_reduce_sum(sq, mesh).sqrt()", PP,
    ),
    Mutant(
        "fsdp_grad_mean", "FSDP's default gradient division (a mean over dp x cp x ep, not a sum)", PARALLEL,
        "            m.set_gradient_divide_factor(1.0)\n", "", CP,
    ),
    Mutant(  # -2.5e-4 on the step-1 gradient norm, < 1e-5 on the losses (AdamW): FP8's 1e-3 missed it
        "fsdp_expert_grad_mean", "FSDP's default gradient division on the experts' unit alone (/ dp x cp)",
        PARALLEL, "            m.set_gradient_divide_factor(1.0)\n",
        "            m.set_gradient_divide_factor(1.0) if m not in _expert_modules(model) else None\n",
        CP, FP32,
    ),
    Mutant(  # y * R - y * (R - 1): the same rows forward (exactly), R times their gradient backward
        "expert_grad_x_ep", "expert rows' gradient x the expert-parallel degree", EXPERTS,
        "seg(pith_ops.moe_unpermute, y_ND,",
        "seg(pith_ops.moe_unpermute, y_ND * self.ranks - y_ND.detach() * (self.ranks - 1),",
        EP, "--train.fp8=true",  # where a 2e-3 loss tolerance missed it (a 3e-4 effect through Adam)
    ),
    Mutant(
        "aux_layers_per_pp_rank", "aux losses averaged over this pipeline rank's MoE layers", TRAIN,
        "for layer in held_layers(whole).values())", "for layer in held_layers(model).values())", PP,
    ),
]  # fmt: skip


def scratch_copy(dest: Path) -> None:
    """The working tree's tracked and untracked-not-ignored files (uncommitted edits included)."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    for f in filter(None, files.split("\0")):
        if (ROOT / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dest / f)


def environment(copy: Path, m: "Mutant | None" = None) -> dict[str, str]:
    """The copy's sources ahead of the editable install's (.pth paths come after PYTHONPATH's)."""
    srcs = [copy / "packages" / p / "src" for p in ("pith-ops", "pith-engine", "pith-models", "pith-train")]
    pins = {"CONFIG_SPACE_LAYOUTS": m.layouts, "CONFIG_SPACE_OPTIONS": m.options} if m else {}
    return {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, srcs)), **pins}


def run_tests(copy: Path, m: Mutant) -> tuple[str, float]:
    """-> (the first failing test, '' if all passed; seconds)."""
    env = environment(copy, m)
    args = [sys.executable, "-m", "pytest", "-n", "0", "-x", "-q", "-p", "no:cacheprovider", "-rf", *m.tests]
    start = time.perf_counter()
    out = subprocess.run(args, cwd=copy, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if out.returncode not in (0, 1):
        raise RuntimeError(f"pytest exited {out.returncode}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    failed = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("FAILED ")]
    return (failed[0].split("/")[-1] if failed else "") if out.returncode else "", seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--baseline", action="store_true", help="first run every test unmutated")
    args = parser.parse_args()
    unknown = set(args.names) - {m.name for m in MUTANTS}
    if unknown:
        sys.exit(f"unknown mutants {sorted(unknown)}; known: {[m.name for m in MUTANTS]}")
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    with tempfile.TemporaryDirectory(prefix="pith-mutants-") as tmp:
        copy = Path(tmp)
        scratch_copy(copy)
        with (copy / "conftest.py").open("a") as f:  # no shrinking: the first failing draw is enough
            f.write(NO_SHRINK)
        where = subprocess.run(
            [sys.executable, "-c", "import pith_engine; print(pith_engine.__file__)"],
            env=environment(copy),
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert where.startswith(str(copy)), f"pith_engine imported from {where}, not the copy"
        if args.baseline:
            for m in {(m.layouts, m.options): m._replace(old="", new="") for m in chosen}.values():
                failed, seconds = run_tests(copy, m)
                print(
                    f"baseline {m.layouts or '1 process'} {m.options}: {failed or 'passed'} ({seconds:.0f} s)"
                )
                if failed:
                    sys.exit("the unmutated tests fail: fix that first")
        rows = []
        for m in chosen:
            path = copy / m.path
            text = path.read_text()
            if text.count(m.old) != 1:
                sys.exit(f"{m.name}: {m.old!r} occurs {text.count(m.old)} times in {m.path}, not once")
            path.write_text(text.replace(m.old, m.new))
            try:
                failed, seconds = run_tests(copy, m)
            finally:
                path.write_text(text)
            rows.append(
                (m.name, m.what, m.layouts or "1 process", f"caught: {failed}" if failed else "SURVIVED")
            )
            print(" | ".join(rows[-1]) + f" | {seconds:.0f} s", flush=True)
    print("\n| mutant | bug | draws pinned to | result |\n| --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if any(r[-1] == "SURVIVED" for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
