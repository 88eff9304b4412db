"""`pith-train check-layout`. Adam eps 1e-3: with 1e-8, near-zero second moments amplify the layouts'
different rounding."""

import signal
import subprocess
import tempfile
from pathlib import Path

from pith_train.config import load_config, model_config
from pith_train.metrics import read_metrics
from pith_train.plan import model_shape, valid
from pith_train.stopping import launch_local
from pith_train.train import pretrain


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run)}


def check_layout(
    config: str | None, overrides: list[str], nproc: int, steps: int, eps: float, rtol: float
) -> bool:
    """Prints a table of per-step losses; True when every step agrees within rtol."""
    cfg = load_config(config, overrides)  # before any process starts
    cfg.started("--nproc", nproc)
    valid(cfg, model_shape(model_config(cfg.model)))  # as pretrain refuses
    same = [f"--train.steps={steps}", f"--optim.eps={eps}", "--checkpoint.every=0", "--log.eval_every=0"]
    same += ["--log.progress=false", "--log.tensorboard=false", "--log.every=0"]
    single = ["--parallel.pp=1", "--parallel.dp=1", "--parallel.cp=1", "--parallel.ep=1"]
    # The load-balancing loss groups a micro-batch over the data ranks: one process takes them all
    single.append(f"--train.micro_batch={cfg.train.micro_batch * cfg.data_ranks}")
    base = [*([config] if config else []), *overrides, *same]
    with tempfile.TemporaryDirectory(prefix="pith-check-layout-") as tmp:
        one, many = Path(tmp) / "one", Path(tmp) / "layout"
        pretrain(load_config(config, [*overrides, *same, *single]), one)  # in this process
        data = [] if cfg.data.path else [f"--data.path={one / 'data'}"]  # the first run's corpus
        code = launch_local(nproc, [*base, *data, "--run-dir", str(many)], subprocess.DEVNULL)  # signals too
        if code in (128 + signal.SIGINT, 128 + signal.SIGTERM):
            raise KeyboardInterrupt
        if code:
            raise ValueError("the layout's run failed (its error is above)")
        want, got = _losses(one), _losses(many)
    p = cfg.parallel
    print(f"layout pp={p.pp} dp={p.dp} cp={p.cp} ep={p.ep} on {nproc} processes, Adam eps {eps:g}")
    print(f"{'step':>4}  {'one process':>12}  {'layout':>12}  {'rel. diff':>9}")
    worst = 0.0
    for step in sorted(want):
        diff = abs(got[step] - want[step]) / abs(want[step])
        worst = max(worst, diff)
        print(f"{step:>4}  {want[step]:>12.6f}  {got[step]:>12.6f}  {diff:>9.2e}")
    ok = sorted(got) == sorted(want) and worst <= rtol
    print(f"{'agrees' if ok else 'DIFFERS'}: largest relative difference {worst:.2e} (tolerance {rtol:g})")
    return ok
