"""Across nodes: configs/multinode.sbatch (its syntax, and the torchrun line it renders under Slurm's
environment with a stand-in `srun` and `scontrol`), and two torchrun agents on this machine as two
nodes of 2 gloo processes (c10d rendezvous) that train, stop when one agent gets SIGTERM, and resume to
the single process's losses."""

import os
import shlex
import subprocess
from pathlib import Path

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
