"""Multi-process (gloo) test support: run a test file as a script, one process per rank."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


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
