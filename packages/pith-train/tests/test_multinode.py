"""Across nodes: configs/multinode.sbatch (its syntax, and the torchrun line it renders under Slurm's
environment with a stand-in `srun` and `scontrol`), and two torchrun agents on this machine as two
nodes of 2 gloo processes (c10d rendezvous) that train, stop when one agent gets SIGTERM, and resume to
the single process's losses."""

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pith_engine import checkpoint
from pith_train.train import pretrain

ROOT = Path(__file__).resolve().parents[3]
SBATCH = ROOT / "configs" / "multinode.sbatch"


def test_the_slurm_script_parses_and_renders_one_torchrun_agent_per_node(tmp_path):
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # scontrol lists the job's hosts; srun prints the command it would start on each node
    (bin_dir / "scontrol").write_text('#!/bin/bash\nprintf "gpu-a17\\ngpu-a18\\n"\n')
    (bin_dir / "srun").write_text('#!/bin/bash\nprintf "%q " "$@" > "$SRUN_OUT"\nenv > "$SRUN_OUT.env"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SRUN_OUT": str(tmp_path / "srun")}
    env |= {"SLURM_JOB_NODELIST": "gpu-a[17-18]", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "4242"}
    args = ["configs/deepseek-v2-lite-8gpu.toml", "--data.path=/data/my set", "--parallel.dp=4"]
    subprocess.run(["bash", str(SBATCH), *args], env=env, check=True, cwd=tmp_path)
    assert shlex.split((tmp_path / "srun").read_text()) == [
        "--kill-on-bad-exit=1", "torchrun", "--nnodes", "2", "--nproc-per-node", "8",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "gpu-a17:29500", "--rdzv-id", "4242",
        "-m", "pith_train", "pretrain", *args, "--run-dir", "runs/slurm-4242",
    ]  # fmt: skip
    seen = dict(
        line.split("=", 1) for line in (tmp_path / "srun.env").read_text().splitlines() if "=" in line
    )
    for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        assert seen[key] == ("0" if key == "NCCL_NVLS_ENABLE" else "1"), key
    header = [line for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --gpus-per-node=8" in header and "#SBATCH --ntasks-per-node=1" in header


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows]


@pytest.mark.distributed
def test_two_nodes_stop_together_on_one_agents_sigterm_and_resume_as_one_process(
    micro_args, micro_config, subprocess_env, tmp_path
):
    run, steps = tmp_path / "run", 8
    layout = ["--parallel.dp=2", "--parallel.ep=2", "--train.micro_batch=1", f"--train.steps={steps}"]
    args = [*micro_args, "--optim.eps=1e-3", "--train.device=cpu", *layout, "--checkpoint.every=0"]
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
                "-m", "pith_train", "pretrain", *args, "--run-dir", str(run)]  # fmt: skip

    started = []

    def agents():
        logs = [(tmp_path / f"node{i}.log").open("a") for i in range(2)]
        started.extend(
            new := [subprocess.Popen(torchrun, env=subprocess_env, stdout=f, stderr=f) for f in logs]
        )
        return new

    read = lambda: "".join((tmp_path / f"node{i}.log").read_text() for i in range(2))
    try:
        nodes, deadline = agents(), time.monotonic() + 300
        while not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text().strip():
            assert time.monotonic() < deadline and all(n.poll() is None for n in nodes), read()
            time.sleep(0.1)
        nodes[1].send_signal(signal.SIGTERM)  # one node's agent: its workers stop, and with them every rank
        assert all(n.wait(120) != 0 for n in nodes), read()
        stopped = _losses(run)[-1][0]
        assert stopped < steps, read()
        (last,) = checkpoint.checkpoints(run / "checkpoints")
        assert last.name == f"step_{stopped:06d}" and checkpoint.problem(last) is None, read()
        assert len(list(last.glob("*.distcp"))) == 4  # every rank's shards, at the same step
        assert f"resume with: {shlex.join(['torchrun', *torchrun[3:]])}\n" in read()  # the agents' line
        assert all(n.wait(300) == 0 for n in agents()), read()
    finally:  # an agent left running by a failed assertion ends, its workers with it
        for agent in started:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    pretrain(
        micro_config("--optim.eps=1e-3", "--train.device=cpu", f"--train.steps={steps}"), tmp_path / "one"
    )
    got, want = _losses(run), _losses(tmp_path / "one")
    assert [s for s, _ in got] == [s for s, _ in want] == list(range(1, steps + 1))
    for (step, loss), (_, ref) in zip(got, want):
        # fp32 summation order (4 ranks of 1 sequence against 2 micro-batches of 2): measured up to 5.6e-5
        assert abs(loss - ref) <= 1e-4 * abs(ref), f"step {step}: {loss} vs one process {ref}"
