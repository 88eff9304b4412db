"""`torchrun ... -m pith_train pretrain --parallel.*=...` trains like one process: 4 gloo processes in
cp2 x ep2 log (rank 0 only) the per-step global-batch losses of the single-process run; layouts that
cannot work stop before any compute with a message naming the numbers."""

import json
import subprocess
import sys

import pytest
from pith_train.layoutcheck import check_layout
from pith_train.train import pretrain

# Adam's default eps (1e-8) turns fp32 summation-order noise in near-zero gradients into visible
# weight differences (see pith-engine's test_equivalence.py); a larger eps keeps runs comparable.
COMPARABLE = ["--optim.eps=1e-3", "--train.device=cpu"]


def _losses(run_dir) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows]


@pytest.mark.distributed
def test_torchrun_cp2_ep2_logs_the_single_process_losses(micro_config, micro_args, tmp_path, subprocess_env):
    pretrain(micro_config(*COMPARABLE), tmp_path / "single")
    expected = _losses(tmp_path / "single")
    run = tmp_path / "cp2_ep2"
    # 4 sequences per step: one per data rank (dp*ep = 2) and micro-batch (2), as the single run's 2.
    layout = ["--parallel.cp=2", "--parallel.ep=2", "--train.micro_batch=1"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    cmd += ["-m", "pith_train", "pretrain", "--run-dir", str(run), *micro_args, *COMPARABLE, *layout]
    proc = subprocess.run(
        cmd, env={**subprocess_env, "OMP_NUM_THREADS": "1"}, capture_output=True, timeout=400
    )
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    got = _losses(run)  # one line per step: only rank 0 writes
    assert [s for s, _ in got] == [s for s, _ in expected], got
    for (step, loss), (_, want) in zip(got, expected):
        assert abs(loss - want) <= 1e-5 * abs(want), f"step {step}: {loss} vs single process {want}"
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == ["step_000004", "step_000006"]


@pytest.mark.parametrize(
    "world, overrides, words",
    [
        ("2", ["--parallel.dp=4", "--train.micro_batch=1"], "world size 2 != pp*dp*cp*ep = 1*4*1*1 = 4"),
        (
            "3",
            ["--parallel.ep=3", "--train.global_batch=6", "--train.micro_batch=1"],
            "4 experts do not divide",
        ),
        ("3", ["--parallel.cp=3"], "sequence length 32 is not divisible by 2*cp = 6"),
        ("2", ["--parallel.pp=2"], "pipeline parallelism is not built yet"),
    ],
)
def test_a_layout_that_cannot_work_stops_before_compute_naming_the_numbers(
    micro_config, tmp_path, monkeypatch, world, overrides, words
):
    monkeypatch.setenv("WORLD_SIZE", world)  # as torchrun sets it
    with pytest.raises(ValueError, match="parallel layout") as e:
        pretrain(micro_config(*overrides), tmp_path / "run")
    assert words in str(e.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.distributed
def test_check_layout_trains_both_ways_and_reports_agreement(micro_args, subprocess_env, monkeypatch, capsys):
    for name, value in subprocess_env.items():  # for the torchrun workers
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = [a for a in micro_args if not a.startswith("--train.steps")]
    assert check_layout(None, [*args, "--parallel.dp=2", "--train.device=cpu"], 2, 2, 1e-3, 1e-5)
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert len(rows) == 2 and all(float(r[3]) <= 1e-5 for r in rows), out
    assert "layout pp=1 dp=2 cp=1 ep=1 on 2 processes, Adam eps 0.001" in out
    assert "agrees: largest relative difference" in out
