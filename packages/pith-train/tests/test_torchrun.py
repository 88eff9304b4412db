"""`pith-train pretrain --parallel.*=...` under torchrun's environment variables trains like one process: 4
gloo processes (conftest's run_ranks, pretrains.py) in cp2 x ep2, pp2 x ep2 and pp4 log (rank 0 only) the
per-step global-batch losses and the validation loss of the single-process run, and a checkpoint written
under pp2 x ep2 (and pp4) resumes on one process with the same losses; check-layout starts its layout's
processes itself (stopping them on a SIGTERM) and reports agreement; layouts that cannot work stop before
any compute with a message naming the numbers."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pith_models
import pytest
import torch
from pith_train.layoutcheck import check_layout
from pith_train.train import pretrain

# Adam's default eps (1e-8) turns fp32 summation-order noise in near-zero gradients into visible
# weight differences (see pith-engine's test_equivalence.py); a larger eps keeps runs comparable.
COMPARABLE = ["--optim.eps=1e-3", "--train.device=cpu"]


def _losses(run_dir) -> list[tuple[int, float]]:
    """(step, loss) per step, and (step, validation loss) for each evaluation (the last step's)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows] + [
        (r["step"], r["val_loss"]) for r in rows if "val_loss" in r
    ]


# cp2 x ep2: 4 sequences per step, one per data rank (dp*ep = 2) and micro-batch (2), as the single
# run's 2. The pipelines: 8 sequences per step in 4 micro-batches (2*pp) of 2 on one process, of 1 per
# data rank (ep2); pp4 in 8 micro-batches; the micro model with more layers, 2 chunks per pipeline rank.
CP2_EP2 = ["--parallel.cp=2", "--parallel.ep=2", "--train.micro_batch=1"]
PIPELINES = [
    (4, ["--train.global_batch=8", "--train.micro_batch=2"], ["--parallel.pp=2", "--parallel.ep=2"]),
    (8, ["--train.global_batch=8", "--train.micro_batch=1"], ["--parallel.pp=4"]),
]


@pytest.fixture(scope="module")
def four_processes(micro_hf, micro_args, tmp_path_factory, pretrains_in_ranks):
    """The 4-process layouts trained in one start of 4 processes (process start dominates): -> their root
    directory, with the run directories cp2_ep2, pp_4 and pp_8 and the Hugging Face directories hf_4 and hf_8.
    """
    root = tmp_path_factory.mktemp("torchrun")
    runs = [(root / "cp2_ep2", [*micro_args, *COMPARABLE, *CP2_EP2])]
    for layers, batch, layout in PIPELINES:
        cfg = dataclasses.replace(pith_models.from_pretrained(micro_hf).cfg, num_hidden_layers=layers)
        model = pith_models.build(cfg, "cpu", seed=0)
        pith_models.save_pretrained(model, root / f"hf_{layers}", dtype=torch.float32)
        overrides = [*COMPARABLE, f"--model.name={root / f'hf_{layers}'}", *batch]
        runs.append((root / f"pp_{layers}", [*micro_args, *overrides, *layout, "--train.micro_batch=1"]))
    pretrains_in_ranks(4, runs)
    # pp2 x ep2 stopped after step 3 and resumed in the same layout (extra runs of the same start)
    args = [*runs[1][1], "--train.lbl_coef=0", "--train.bias_rate=0"]
    resumed = [{"run_dir": str(root / "pp_resumed"), "argv": args, "stop_at": 3}]
    resumed += [
        {"run_dir": str(root / "pp_resumed"), "argv": args},
        {"run_dir": str(root / "pp_whole"), "argv": args},
    ]
    pretrains_in_ranks(4, [(root / "pp_resumed", r) for r in resumed])
    return root


@pytest.mark.distributed
def test_torchrun_cp2_ep2_logs_the_single_process_losses(micro_config, four_processes, tmp_path):
    pretrain(micro_config(*COMPARABLE), tmp_path / "single")
    expected = _losses(tmp_path / "single")
    run = four_processes / "cp2_ep2"
    got = _losses(run)  # one line per step: only rank 0 writes
    assert [s for s, _ in got] == [s for s, _ in expected], got
    for (step, loss), (_, want) in zip(got, expected):
        assert abs(loss - want) <= 1e-5 * abs(want), f"step {step}: {loss} vs single process {want}"
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == ["step_000004", "step_000006"]


def _assert_same(got, expected, where):
    assert [s for s, _ in got] == [s for s, _ in expected], (where, got)
    for (step, loss), (_, want) in zip(got, expected):
        assert abs(loss - want) <= 1e-5 * abs(want), f"{where} step {step}: {loss} vs single process {want}"


@pytest.mark.distributed
@pytest.mark.parametrize("layers, batch, layout", PIPELINES)
def test_torchrun_pipeline_logs_the_single_process_losses_and_its_checkpoint_resumes_on_one_process(
    micro_config, four_processes, tmp_path, layers, batch, layout
):
    overrides = [*COMPARABLE, f"--model.name={four_processes / f'hf_{layers}'}", *batch]
    pretrain(micro_config(*overrides), tmp_path / "single")
    expected = _losses(tmp_path / "single")
    run = four_processes / f"pp_{layers}"
    _assert_same(_losses(run), expected, f"{layout}")
    # Its step-4 checkpoint resumes on one process: steps 5 and 6 as the uninterrupted run's.
    resumed = tmp_path / "resumed"
    shutil.copytree(run / "checkpoints" / "step_000004", resumed / "checkpoints" / "step_000004")
    pretrain(micro_config(*overrides), resumed)
    _assert_same(_losses(resumed), expected[4:], f"{layout} -> 1 process")


@pytest.mark.distributed
def test_a_pipeline_checkpoint_resumes_in_the_pipeline_bit_for_bit(four_processes):
    """Each pipeline rank holds other parameters: the optimizer's param groups (which name them) once
    came back from the checkpoint as another rank's (KeyError 'betas' on resuming pp2)."""
    assert _losses(four_processes / "pp_resumed") == _losses(four_processes / "pp_whole")


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
        ("2", ["--parallel.pp=2"], "at least 2*pp = 4 micro-batches per step, got 2"),
        ("2", ["--parallel.pp=2", "--train.global_batch=8"], "2 layers cannot fill 2*pp = 4 chunks"),
    ],
)
def test_a_layout_that_cannot_work_stops_before_compute_naming_the_numbers(
    micro_config, tmp_path, monkeypatch, world, overrides, words
):
    monkeypatch.setenv("WORLD_SIZE", world)  # as torchrun sets it
    with pytest.raises(ValueError, match="parallel layout|pipeline") as e:
        pretrain(micro_config(*overrides), tmp_path / "run")
    assert words in str(e.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.distributed
def test_check_layout_trains_both_ways_and_reports_agreement(micro_args, subprocess_env, monkeypatch, capsys):
    for name, value in subprocess_env.items():  # for the torchrun workers
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    # 4 steps (the command's default): the load-balancing loss groups a micro-batch's sequences over
    # the data ranks (2 x 2 here), so the one-process run must take micro-batches of 4, not 2
    args = [a for a in micro_args if not a.startswith("--train.steps")]
    assert check_layout(None, [*args, "--parallel.dp=2", "--train.device=cpu"], 2, 4, 1e-3, 1e-5), (
        capsys.readouterr().out
    )
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["2"], ["3"], ["4"])]
    assert len(rows) == 4 and all(float(r[3]) <= 1e-5 for r in rows), out
    assert "layout pp=1 dp=2 cp=1 ep=1 on 2 processes, Adam eps 0.001" in out
    assert "agrees: largest relative difference" in out


def test_pretrain_under_torchrun_leaves_the_process_group_before_it_exits(
    micro_args, tmp_path, monkeypatch, capsys
):
    """A gloo group left to the interpreter's exit can abort a rank that has finished ("terminate called
    without an active exception", SIGABRT, seen once in a check-layout run), so `pith-train pretrain`
    destroys the group when training ends, as TorchTitan's entry point does."""
    import socket

    import torch.distributed as dist
    from pith_train.cli import main

    assert not dist.is_initialized()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": 1, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    try:
        main(["pretrain", *micro_args, *COMPARABLE, "--train.steps=1", "--run-dir", str(tmp_path / "run")])
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert "done: step 1" in capsys.readouterr().out


def _marked(mark: str) -> dict[int, bytes]:
    """The processes whose environment holds PITH_TEST_MARK=mark -> their command lines."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if f"PITH_TEST_MARK={mark}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found[int(pid)] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:  # gone, or not ours
            pass
    return found


@pytest.mark.distributed
def test_sigterm_to_check_layout_stops_its_layout_run_and_leaves_no_process(
    micro_args, subprocess_env, tmp_path
):
    """check-layout ran torchrun through subprocess.run: a SIGTERM (a scheduler's stop, `kill`) ended it
    at once and left torchrun's agent and workers training, orphaned. Now its workers get the signal,
    stop as a run does, and it exits as interrupted."""
    mark = uuid.uuid4().hex
    args = [a for a in micro_args if not a.startswith(("--train.steps", "--checkpoint"))]
    cmd = [sys.executable, "-m", "pith_train", "check-layout", "--nproc", "2", "--steps", "100", *args]
    cmd += ["--parallel.dp=2", "--train.micro_batch=1", "--train.device=cpu"]
    log = (tmp_path / "err").open("wb")  # not a pipe: its reader would wait for orphans holding it
    parent = subprocess.Popen(cmd, env={**subprocess_env, "PITH_TEST_MARK": mark}, stderr=log)
    workers = lambda: [pid for pid, line in _marked(mark).items() if b"pith_train pretrain" in line]
    try:
        deadline = time.monotonic() + 300
        while len(workers()) < 2 and parent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)  # until the layout's two workers have started
        assert parent.poll() is None and len(workers()) >= 2, "the layout run did not start"
        time.sleep(3)
        parent.send_signal(signal.SIGTERM)
        parent.wait(timeout=120)
        err = (tmp_path / "err").read_bytes()
        deadline = time.monotonic() + 5  # the workers had more steps to go
        while _marked(mark) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = list(_marked(mark).values())
        assert not left, f"left running after check-layout exited {parent.returncode}: {left}"
        assert parent.returncode == 130 and b"pith-train check-layout: interrupted" in err, err[-2000:]
    finally:
        for pid in _marked(mark):
            os.kill(pid, signal.SIGKILL)
