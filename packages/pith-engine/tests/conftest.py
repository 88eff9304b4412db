"""Multi-process (gloo) test support: run a test file as a script, one process per rank."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor


def _run_ranks(script: str, world: int, tmp: Path, *args: str, timeout: float = 400) -> None:
    """Run `python script world rank tmp *args` for every rank; fail with every rank's output if any
    rank fails. Ranks use the Triton kernels' plain-PyTorch references (no interpreter) for speed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(world), str(rank), str(tmp), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for rank in range(world)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    report = [
        f"rank {r} (exit {p.returncode}) ---\n{log[-3000:]}" for r, (p, log) in enumerate(zip(procs, logs))
    ]
    assert all(p.returncode == 0 for p in procs), "\n".join(report)


@pytest.fixture
def run_ranks():
    return _run_ranks


class ScaledAdamW(torch.optim.AdamW):
    """torch's AdamW with the step's `grad_scale` (the clip coefficient that pith_engine.step.train_step
    hands the optimizer, as pith_train.optim.AdamW takes it) applied to the gradients first."""

    def step(self, closure=None, grad_scale=None):
        if grad_scale is not None:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                        g.mul_(grad_scale)
        return super().step(closure)


@pytest.fixture
def scaled_adamw():
    return ScaledAdamW
