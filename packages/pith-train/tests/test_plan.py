"""`pith-train plan` (pith_train.plan) and the check `pretrain` and `bench` run with it: a run that cannot
fit, or a layout for more processes than were started, stops before anything is built, saying why.
"""

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pith_train.config import load_config
from pith_train.train import pretrain

ROOT = Path(__file__).resolve().parents[3]


def test_a_layout_for_more_processes_names_torchrun(tmp_path):
    cfg = load_config(str(ROOT / "configs" / "qwen3-30b-a3b-8gpu.toml"))
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 8 -m pith_train pretrain CONFIG"):
        pretrain(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def _available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) * 1024


def test_a_run_that_cannot_fit_the_cpu_stops_within_seconds_before_it_allocates(tmp_path):
    # The bench workload's 3.11B parameters in fp32 with AdamW alone take 46 GiB.
    if _available() > 46 * 2**30:
        pytest.skip("this machine may hold the bench workload on CPU")
    env = {
        k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    }
    runs = {  # the 1-GPU preset on CPU, and the bench's workload (no --tiny) on CPU, side by side
        "pretrain": [
            "pretrain",
            str(ROOT / "configs" / "bench-qwen3-4layers-1gpu.toml"),
            "--train.device=cpu",
        ],
        "bench": ["bench", "--device", "cpu"],
    }
    # A safety net should the check regress: allocations past 6 GiB fail instead of taking the machine.
    limit = lambda: resource.setrlimit(resource.RLIMIT_DATA, (6 * 2**30, 6 * 2**30))
    start, procs = time.perf_counter(), {}
    for name, args in runs.items():
        with open(tmp_path / name, "w") as err:
            command = [sys.executable, "-m", "pith_train", *args]
            out = subprocess.DEVNULL
            procs[name] = subprocess.Popen(
                command, cwd=tmp_path, env=env, stdout=out, stderr=err, preexec_fn=limit
            )
    for name, proc in procs.items():
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak resident memory (KiB on Linux)
        message = (tmp_path / name).read_text()
        assert os.waitstatus_to_exitcode(status) == 1, message
        assert message.startswith(f"pith-train {name}: error: plan:") and len(message.splitlines()) == 1, (
            message
        )
        assert "GiB" in message and "a smaller model" in message, message
        assert usage.ru_maxrss < 2 * 2**20, f"{name}: {usage.ru_maxrss / 2**20:.1f} GiB resident"
    assert time.perf_counter() - start < 120  # importing torch is most of it (~10 s on a busy 2-core box)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench", "pretrain"]  # nothing written
