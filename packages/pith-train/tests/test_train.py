import dataclasses
import importlib.machinery
import json
import math
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path

import pith_models
import pytest
import torch
from pith_engine import checkpoint, parallel
from pith_engine.step import Stages, train_step
from pith_models import qwen3_moe
from pith_train import rundir, stopping, train
from pith_train.cli import main
from pith_train.config import load_config, model_config, to_toml
from pith_train.data import Blend
from pith_train.optim import build_optimizer, lr_at
from pith_train.optim import build_optimizer as train_build
from pith_train.prepare import prepare, stdlib_corpus
from pith_train.train import flops_per_token, fp8_size_problems, parallel_layout, pretrain, step_settings


def _losses(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows}
    assert len(losses) == len(rows), [r["step"] for r in rows]  # one record per step, replays included
    return losses


@pytest.fixture(scope="module")
def reference(micro_config, tmp_path_factory):
    """Per-step losses of the uninterrupted 6-step run."""
    run = tmp_path_factory.mktemp("reference")
    out = pretrain(micro_config(), run)
    losses = _losses(run)
    assert out["step"] == 6 and sorted(losses) == list(range(1, 7))
    # TensorBoard has the same scalars.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("loss")] == sorted(losses.items())
    assert {"lr", "grad_norm", "expert_load_max_over_mean/layer_1"} <= set(events.Tags()["scalars"])
    return losses


@pytest.mark.parametrize("fp8", [False, True])
def test_stop_and_resume_reproduces_the_uninterrupted_losses_exactly(micro_config, reference, tmp_path, fp8):
    """Also in FP8, whose weights' kept e4m3 copies carry the scale of the weights before the last
    update (delayed scaling): the checkpoint restores it, or the resumed run's first forward would
    quantise with the loaded weights' own amax."""
    flags = ["--train.fp8=true"] if fp8 else []
    if fp8:
        pretrain(micro_config(*flags), tmp_path / "straight")
        reference = _losses(tmp_path / "straight")
    assert reference[6] < reference[1] - 0.3  # it learns
    run = tmp_path / "resumed"
    pretrain(micro_config(*flags), run, stop_at=3)
    assert [p.name for p in checkpoint.checkpoints(run / "checkpoints")] == ["step_000002", "step_000003"]
    pretrain(micro_config(*flags), run)
    assert _losses(run) == reference  # exact equality, on CPU
    assert [p.name for p in checkpoint.checkpoints(run / "checkpoints")] == ["step_000004", "step_000006"]


def test_a_resume_reads_the_checkpoint_not_the_released_weights_it_started_from(
    micro_config, micro_hf, reference, tmp_path
):
    """A run from a Hugging Face directory read the release's weights again on every resume (a full
    read of a 30B model, to be overwritten), and could not resume once they had moved."""
    shutil.copytree(micro_hf, tmp_path / "hf")
    run, release = tmp_path / "run", f"--model.name={tmp_path / 'hf'}"
    pretrain(micro_config(release), run, stop_at=3)
    (tmp_path / "hf" / "model.safetensors").unlink()  # config.json stays: the model's shape
    pretrain(micro_config(release), run)
    assert _losses(run) == reference


KILL_DURING_SAVE = """
import os, signal, sys
import torch.distributed.checkpoint as dcp
from pith_train.cli import main
real_save = dcp.save
def save_then_die(state, checkpoint_id, **options):  # DCP files written, the rename not done yet
    real_save(state, checkpoint_id=checkpoint_id, **options)
    if str(checkpoint_id).endswith("step_000004.tmp"):
        os.kill(os.getpid(), signal.SIGKILL)
dcp.save = save_then_die
main(sys.argv[1:])
"""


def test_sigkill_while_saving_keeps_the_previous_checkpoint_and_resume_uses_it(
    micro_args, micro_config, reference, tmp_path, subprocess_env
):
    run = tmp_path / "killed"
    args = ["pretrain", "--run-dir", str(run), *micro_args]
    proc = subprocess.run(
        [sys.executable, "-c", KILL_DURING_SAVE, *args], env=subprocess_env, capture_output=True
    )
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    ckpts = run / "checkpoints"
    assert [p.name for p in checkpoint.checkpoints(ckpts)] == ["step_000002"]
    assert (ckpts / "step_000004.tmp").is_dir()
    pretrain(micro_config(), run)  # resumes from step 2, re-runs steps 3-6
    assert _losses(run) == reference
    assert not (ckpts / "step_000004.tmp").exists()


def test_nan_loss_stops_naming_the_step_and_keeps_the_last_checkpoint(micro_config, micro_hf, tmp_path):
    # A learning rate of 1e38 (an infinite one is refused) turns the weights into inf/nan at the first update.
    cfg = micro_config("--train.lr=1e38", "--checkpoint.every=1")
    with pytest.raises(FloatingPointError, match=r"loss is nan .*at step 2;.*step_000001"):
        pretrain(cfg, tmp_path)
    assert [p.name for p in checkpoint.checkpoints(tmp_path / "checkpoints")] == ["step_000001"]
    model = pith_models.from_pretrained(micro_hf)
    checkpoint.load(tmp_path / "checkpoints" / "step_000001", model)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--data.path={tmp}/missing"], "does not exist"),
        (["--model.name=no-such-model", "--data.path="], "not a known model"),
        (["--model.name=qwen3-moe-tiny"], "vocab size 257 .* more than the model's 128"),
        (
            ["--data.tokenizer={tmp}/tokenizer.json"],
            r"made with tokenizer byte .*: use the tokenizer it was made with, or prepare it with this one",
        ),
        (["--model.name={tmp}"], "needs a config.json"),
        (["--data.val_path={tmp}"], "data.val_path '.*': no prepared dataset there"),
        (["--data.path={tmp}", "--data.val_path={tmp}/"], "data.val_path is data.path"),
    ],
)
def test_bad_inputs_stop_before_any_compute(micro_args, tmp_path, overrides, message):
    (tmp_path / "tokenizer.json").write_text(
        json.dumps(
            {"model": {"type": "WordLevel", "vocab": {"<|endoftext|>": 0}, "unk_token": "<|endoftext|>"}}
        )
    )
    cfg = load_config(None, [*micro_args, *(o.format(tmp=tmp_path) for o in overrides)])
    run = tmp_path / "run"
    with pytest.raises(ValueError, match=message):
        pretrain(cfg, run)
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()
    assert not (run / "data").exists()  # the built-in corpus was not prepared either


@pytest.mark.parametrize("key", ["data.path", "data.val_path"])
def test_a_token_id_past_the_model_vocabulary_is_refused_at_start(
    micro_config, byte_data, bad_data, tmp_path, key
):
    bad = bad_data  # the micro model's vocabulary is 260
    val = [f"--data.val_path={byte_data}"] * (key == "data.path")
    with pytest.raises(
        ValueError,
        match=f"dataset {bad} holds token id 300, more than the model's 260: .*--model.vocab_size=320",
    ):
        pretrain(micro_config(f"--{key}={bad}", *val), tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_data_error_mid_run_saves_the_steps_trained(micro_config, tmp_path, monkeypatch):
    real = Blend.step_batch

    def third_step_bad(self, cursor, *args):  # the file changed under the run after two steps
        micro = real(self, cursor, *args)
        if cursor == 8:
            micro[0][0][0, 0] = 300
        return micro

    monkeypatch.setattr(Blend, "step_batch", third_step_bad)
    with pytest.raises(ValueError, match="token id 300 .* in step 3's windows; saved step 2"):
        pretrain(micro_config("--checkpoint.every=0"), tmp_path)
    assert [p.name for p in checkpoint.checkpoints(tmp_path / "checkpoints")] == ["step_000002"]


def test_flops_per_token_counts_active_weights_and_attention(micro_hf):
    model = pith_models.from_pretrained(micro_hf)
    D, F, E, K, L, H, G, Dh = 32, 16, 4, 2, 2, 2, 1, 16
    attn_w = D * H * Dh * 2 + D * G * Dh * 2  # q, o, k, v
    per_layer = attn_w + D * E + K * 3 * D * F  # router, K of E SwiGLU experts
    n_active = L * per_layer + 260 * D  # + lm_head (the embedding lookup is free)
    assert flops_per_token(model, 32) == 6 * n_active + 6 * L * 32 * H * (Dh + Dh)


def test_no_mfu_is_logged_where_no_peak_flops_are_known(micro_config, tmp_path, capsys):
    pretrain(micro_config("--train.steps=1", "--log.every=1", "--log.tensorboard=false"), tmp_path)
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "mfu" not in row and "tokens_per_s" in row  # a measured CPU matmul gave MFU above 100%
    assert " mfu " not in capsys.readouterr().err


def test_lr_schedules():
    cos = load_config(
        None, ["--train.steps=101", "--optim.warmup_steps=10", "--train.lr=1", "--optim.min_lr_ratio=0.1"]
    )
    assert [lr_at(s, cos) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert lr_at(100, cos) == pytest.approx(0.1) and lr_at(55, cos) == pytest.approx(0.55)
    assert all(lr_at(s, cos) >= lr_at(s + 1, cos) for s in range(9, 100))
    wsd = load_config(None, ["--train.steps=100", "--optim.warmup_steps=10", "--optim.schedule=wsd"])
    peak = wsd.train.lr
    assert lr_at(10, wsd) == lr_at(79, wsd) == peak
    assert lr_at(99, wsd) == pytest.approx(peak * wsd.optim.min_lr_ratio)
    assert lr_at(80, wsd) < peak


@pytest.mark.parametrize("warmup, steps", [(6, 6), (12, 6)])
def test_a_warmup_that_never_reaches_the_peak_is_named_with_both_numbers(
    micro_config, tmp_path, warmup, steps
):
    cfg, said = micro_config(f"--optim.warmup_steps={warmup}", f"--train.steps={steps}"), []
    rundir.preflight(cfg, tmp_path, model_config(cfg.model), parallel.SINGLE, said.append)
    assert any(f"optim.warmup_steps={warmup} >= train.steps={steps}" in s for s in said), said


def _syncs_of_a_step(moe_layers: int) -> list[str]:
    """file:line of each synchronising call of the third eager train_step on CUDA (two warm-up steps:
    the optimizer's state and the kept weight casts are made in the first, a one-time sync of torch's
    own came in the second on the H200)."""
    model_cfg = dataclasses.replace(
        qwen3_moe.TINY, vocab_size=260, num_hidden_layers=moe_layers, mlp_only_layers=()
    )
    model = pith_models.build(model_cfg, "cuda", 0)
    cfg = load_config(None, ["--train.global_batch=2", "--train.micro_batch=2", "--data.seq_len=32"])
    stages = Stages(model, parallel_layout(cfg, torch.device("cuda")), False, "none", torch.bfloat16)
    optimizer, settings = build_optimizer(model, cfg), step_settings(cfg, model)
    ids_BS = torch.randint(0, 260, (2, 33), device="cuda")
    micro = [(ids_BS[:, :-1], ids_BS[:, 1:])]
    for _ in range(2):
        train_step(stages, optimizer, micro, 1e-3, *settings)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            train_step(stages, optimizer, micro, 1e-3, *settings)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


@pytest.mark.gpu
def test_host_syncs_of_a_step_none_per_moe_layer_and_none_in_the_model_or_engine():
    """Synchronising calls of one eager single-process train_step on CUDA, counted with torch's sync
    debug mode after a warm-up step: the same with 1 and 3 MoE layers (none per layer), and none from
    the model, engine or operator code; those left are the step's own (printed: label-token count,
    loss .item()s, gradient norm)."""
    # 1 layer measured twice, before and after 3: a one-time sync of torch's showed in the first
    # model's third step on the H200 (torch/cuda/__init__.py), in no later model's.
    first, three, again = _syncs_of_a_step(1), _syncs_of_a_step(3), _syncs_of_a_step(1)
    one = min(first, again, key=len)
    print(f"host syncs per step: {len(one)}: {one}")
    assert len(three) == len(one), (one, three)
    assert not [s for s in three if any(f"/{p}/" in s for p in ("pith_ops", "pith_engine", "pith_models"))], (
        three
    )


@pytest.mark.gpu
def test_default_model_trains_on_cuda_with_compile_bf16_and_resumes(tmp_path):
    """The GPU path: bf16 autocast, compiled stages, fused AdamW; learns, and resumes from a checkpoint."""
    args = ["--train.steps=40", "--checkpoint.every=20", "--log.progress=false", "--log.eval_every=20"]
    cfg = load_config(None, args)
    assert cfg.train.compile and cfg.train.device == "auto"
    pretrain(cfg, tmp_path, stop_at=20)
    out = pretrain(cfg, tmp_path)
    losses = _losses(tmp_path)
    assert sorted(losses) == list(range(1, 41)) and out["step"] == 40
    assert all(math.isfinite(v) for v in losses.values())
    assert losses[1] > 5 and out["val_loss"] < losses[1] - 2  # 5.55 (ln 257) at the start
    assert [p.name for p in checkpoint.checkpoints(tmp_path / "checkpoints")] == [
        "step_000020",
        "step_000040",
    ]


def test_weight_decay_skips_vectors_including_stacked_expert_biases():
    model = pith_models.build("gpt-oss-tiny", "cpu")
    optimizer = build_optimizer(model, load_config(None, ["--optim.weight_decay=0.1"]))
    decay = {id(p) for g in optimizer.param_groups if g["weight_decay"] for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in decay}
    assert "layers.0.mlp.experts.w_gate_up" in names and "layers.0.self_attn.q_proj.weight" in names
    assert not {"layers.0.mlp.experts.b_gate_up", "layers.0.mlp.experts.b_down"} & names
    assert all(model.get_parameter(n).ndim >= 2 for n in names)


def _damage(ckpt, what: str) -> None:
    if what == "weights":  # NaN bytes over part of a weight file: DCP alone would load them silently
        f = next(ckpt.glob("*.distcp"))
        data = bytearray(f.read_bytes())
        data[len(data) // 2 : len(data) // 2 + 8] = struct.pack("<2f", math.nan, math.nan)
        f.write_bytes(bytes(data))
    else:
        (ckpt / "trainer.json").write_text('{"step":\n')


@pytest.mark.parametrize("what", ["weights", "trainer.json"])
def test_resume_falls_back_past_a_damaged_newest_checkpoint(micro_config, reference, tmp_path, capsys, what):
    run = tmp_path / "run"
    pretrain(micro_config(), run, stop_at=4)
    _damage(run / "checkpoints" / "step_000004", what)
    pretrain(micro_config(), run)  # resumes from step 2
    warning = capsys.readouterr().out
    assert "step_000004 is damaged" in warning and "step_000004.damaged" in warning
    assert ("SHA-256" if what == "weights" else "trainer.json has") in warning
    assert _losses(run) == reference
    assert [p.name for p in checkpoint.checkpoints(run / "checkpoints")] == ["step_000004", "step_000006"]
    assert (run / "checkpoints" / "step_000004.damaged").is_dir()  # kept, out of the way


def test_nan_stop_names_the_last_intact_checkpoint(micro_config, tmp_path, monkeypatch):
    real_step, calls = train.train_step, []

    def diverge_at_step_3(*args):
        calls.append(1)
        if len(calls) == 3:  # step 2's checkpoint was damaged since it was written
            _damage(tmp_path / "checkpoints" / "step_000002", "weights")
            raise FloatingPointError("loss is nan (aux 0.0)")
        return real_step(*args)

    monkeypatch.setattr(train, "train_step", diverge_at_step_3)
    with pytest.raises(FloatingPointError, match=r"at step 3;.*step_000001$"):
        pretrain(micro_config("--checkpoint.every=1", "--checkpoint.keep=3"), tmp_path)


def test_a_fresh_run_refuses_a_directory_holding_another_run_naming_everything_there(micro_config, tmp_path):
    pretrain(micro_config("--checkpoint.every=1", "--checkpoint.keep=3"), tmp_path, stop_at=2)
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    held = (
        r"holds an earlier run \(checkpoints/step_000001, checkpoints/step_000002, config.toml, metrics.jsonl"
    )
    with pytest.raises(ValueError, match=rf"checkpoint.resume is false, but .* {held}, tensorboard/events"):
        pretrain(micro_config("--checkpoint.resume=false", "--checkpoint.keep=3"), tmp_path)
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before  # nothing touched


def test_a_run_whose_checkpoints_are_all_damaged_is_never_restarted_silently(micro_config, tmp_path, capsys):
    pretrain(micro_config("--checkpoint.every=1"), tmp_path, stop_at=2)
    for step in (1, 2):
        _damage(tmp_path / "checkpoints" / f"step_00000{step}", "weights")
    metrics = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match="no intact checkpoint"):  # the first launch moves them aside
        pretrain(micro_config("--checkpoint.every=1"), tmp_path)
    held = r"holds an earlier run \(checkpoints/step_000001.damaged, checkpoints/step_000002.damaged, metrics"
    with pytest.raises(ValueError, match=rf"there is no intact checkpoint to resume from, but .* {held}"):
        pretrain(micro_config("--checkpoint.every=1"), tmp_path)  # the same command again
    assert (tmp_path / "metrics.jsonl").read_text() == metrics


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--data.seq_len=16"], "data.seq_len 32 -> 16 would change which sequences"),
        (["--train.seed=1"], "train.seed 0 -> 1"),
        (["--train.global_batch=8"], "train.global_batch 4 -> 8"),
        (["--data.val_path={val}"], r"data.val_path \[\] -> \['.*val'\] would change which sequences"),
        (["--data.val_path=elsewhere"], "data.val_path 'elsewhere': no prepared dataset there"),
        (["--model.name=qwen3-moe-tiny"], "another model than model.name='qwen3-moe-tiny'"),
        (
            ["--train.steps=12"],
            r"disagrees with step 4 of the 4 steps trained \(step 4 trained at lr 0.00775, the new"
            r" schedule gives 0.00972862\).* schedule from step 0: --checkpoint.init_from=",
        ),
        (["--train.steps=5", "--optim.warmup_steps=1"], "disagrees with step 1, steps 3-4 of the 4 steps"),
        (["--optim.name=muon"], "holds adamw's optimizer state: set optim.name=adamw"),
    ],
)
def test_resume_is_checked_against_the_run(micro_config, tmp_path, overrides, message):
    pretrain(micro_config(), tmp_path, stop_at=4)
    saved = (tmp_path / "config.toml").read_text()
    val = tmp_path / "val"
    prepare(stdlib_corpus()[3:4], str(val), "byte", progress=False, workers=1)
    with pytest.raises(ValueError, match=message):
        pretrain(micro_config(*(o.format(val=val) for o in overrides)), tmp_path)
    assert (tmp_path / "config.toml").read_text() == saved  # a refused launch rewrites nothing
    assert [p.name for p in checkpoint.checkpoints(tmp_path / "checkpoints")] == [
        "step_000002",
        "step_000004",
    ]


def test_a_resume_knows_its_data_by_content_not_by_path(micro_config, byte_data, tmp_path, monkeypatch):
    """The same dataset given by a relative path, a symlink, or moved elsewhere resumes; so does a changed
    data.val_windows under data.val_path (no window is held out); other data is refused."""
    shutil.copytree(byte_data, tmp_path / "data")
    prepare(stdlib_corpus()[3:4], str(tmp_path / "val"), "byte", progress=False, workers=1)
    run, val = tmp_path / "run", f"--data.val_path={tmp_path / 'val'}"
    pretrain(micro_config(f"--data.path={tmp_path / 'data'}", val), tmp_path / "straight")
    pretrain(micro_config(f"--data.path={tmp_path / 'data'}", val), run, stop_at=2)
    monkeypatch.chdir(tmp_path)
    pretrain(micro_config("--data.path=data", "--data.val_path=val", "--data.val_windows=2"), run, stop_at=3)
    (tmp_path / "link").symlink_to(tmp_path / "data")
    pretrain(micro_config("--data.path=link", val), run, stop_at=4)
    (tmp_path / "data").rename(tmp_path / "moved")
    with pytest.raises(ValueError, match="data.path .* would change which sequences"):
        pretrain(micro_config(f"--data.path={tmp_path / 'val'}", val), run)
    pretrain(micro_config("--data.path=moved", val), run)
    assert _losses(run) == _losses(tmp_path / "straight")


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_a_resume_trains_with_the_config_optimizer_settings_and_says_so(
    micro_config, tmp_path, monkeypatch, capsys, name
):
    built = []
    monkeypatch.setattr(train, "build_optimizer", lambda *a: built.append(train_build(*a)) or built[-1])
    pretrain(micro_config(f"--optim.name={name}"), tmp_path, stop_at=2)
    new = ["--optim.weight_decay=0.0", "--optim.beta2=0.999", "--optim.eps=1e-6", "--optim.muon_momentum=0.8"]
    pretrain(micro_config(f"--optim.name={name}", *new), tmp_path)
    groups = built[-1].param_groups
    assert [g["weight_decay"] for g in groups] == [0.0] * len(groups)
    adamw = [g for g in groups if "betas" in g]
    assert adamw and all(g["betas"] == (0.9, 0.999) and g["eps"] == 1e-6 for g in adamw)
    assert all(g["momentum"] == 0.8 for g in groups if "momentum" in g)
    assert len(adamw) < len(groups) if name == "muon" else len(adamw) == len(groups)
    changes = "optim.muon_momentum 0.95 -> 0.8, optim.weight_decay 0.1 -> 0.0, optim.beta2 0.95 -> 0.999"
    assert f"not the run's: {changes}, optim.eps 1e-08 -> 1e-06" in capsys.readouterr().out


def test_a_finished_cosine_run_extends_as_a_new_run_from_its_weights_and_optimizer_state(
    micro_config, reference, tmp_path, capsys
):
    done = tmp_path / "done"
    pretrain(micro_config(), done)  # 6 steps: its cosine schedule has decayed
    ckpt = done / "checkpoints" / "step_000006"
    longer = micro_config("--train.steps=4", f"--checkpoint.init_from={ckpt}")
    pretrain(longer, tmp_path / "more")
    note = "(step 6 of its run): its weights and optimizer state, this config's schedule from step 0, the"
    assert note + " data from sequence 24" in capsys.readouterr().out  # 6 steps of 4: new sequences follow
    losses = _losses(tmp_path / "more")
    assert sorted(losses) == [1, 2, 3, 4] and losses[1] < reference[1] - 0.3  # trained weights
    state = json.loads((tmp_path / "more" / "checkpoints" / "step_000004" / "trainer.json").read_text())
    assert (state["step"], state["cursor"]) == (4, 24 + 16)
    pretrain(longer, tmp_path / "more")  # finished: its own checkpoint, not init_from, decides
    assert sorted(_losses(tmp_path / "more")) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="init_from='nope' is not a Pith checkpoint"):
        pretrain(micro_config("--checkpoint.init_from=nope"), tmp_path / "bad")


@pytest.mark.parametrize("with_run_config", [False, True])
def test_init_from_weights_only_says_so_and_names_model_name(
    micro_config, micro_hf, tmp_path, with_run_config
):
    hf = tmp_path / "hf"
    shutil.copytree(micro_hf, hf)
    if with_run_config:  # an exported run's: convert carries it back
        (hf / "config.toml").write_text(to_toml(micro_config()))
    main(["convert", str(hf), str(tmp_path / "ckpt")])
    with pytest.raises(ValueError, match=f"weights only .*: use --model.name={tmp_path / 'ckpt'}"):
        pretrain(micro_config(f"--checkpoint.init_from={tmp_path / 'ckpt'}"), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_wsd_run_extends_before_its_decay_and_micro_batch_may_change(micro_config, tmp_path):
    wsd = ["--optim.schedule=wsd", "--optim.decay_fraction=0.25"]
    pretrain(micro_config(*wsd, "--train.steps=8"), tmp_path, stop_at=4)
    out = pretrain(micro_config(*wsd, "--train.steps=10", "--train.micro_batch=1"), tmp_path)
    assert out["step"] == 10 and sorted(_losses(tmp_path)) == list(range(1, 11))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["--data.seq_len=128"],
            "data.seq_len=128 is more than the model's max_position_embeddings \\(64\\)",
        ),
        (["--log.wandb=my-project"], "wandb is not installed"),
        (["--train.cuda_graph=true", "--train.device=cpu"], "train.cuda_graph needs a CUDA device"),
        (["--data.path=/nonexistent"], "data.path '/nonexistent' does not exist"),  # made the run dir
        (["--data.val_path=/nonexistent"], "data.val_path '/nonexistent': no prepared dataset"),
    ],
)
def test_unusable_settings_stop_before_compute(micro_config, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        pretrain(micro_config(*overrides), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_unwritable_checkpoints_directory_stops_before_compute(micro_config, tmp_path):
    (tmp_path / "checkpoints").write_text("a file where the directory should be")
    with pytest.raises(ValueError, match="checkpoints cannot be written .*not a directory"):
        pretrain(micro_config(), tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "config.toml").exists()


def test_wandb_gets_every_step_when_installed_and_asked(micro_config, tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, scalars, step):
            calls.append((step, scalars["loss"]))

        def finish(self):
            calls.append("finish")

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kw: calls.append(kw["project"]) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    pretrain(micro_config("--log.wandb=proj", "--train.steps=2"), tmp_path)
    assert calls[0] == "proj" and [c[0] for c in calls[1:-1]] == [1, 2] and calls[-1] == "finish"


def test_sigterm_finishes_the_step_saves_and_exits_with_a_resume_hint(
    micro_args, micro_config, reference, tmp_path, monkeypatch, capsys
):
    run, real_step, calls = tmp_path / "run", train.train_step, []

    def step_with_sigterm_at_3(*args):
        calls.append(1)
        if len(calls) == 3:  # arrives mid-step; the step must still finish
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(*args)

    monkeypatch.setattr(train, "train_step", step_with_sigterm_at_3)
    with pytest.raises(SystemExit) as e:
        main(["pretrain", *micro_args, "--run-dir", str(run)])
    assert e.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone with the loop
    err = capsys.readouterr().err
    assert "Traceback" not in err and "stopped by SIGTERM after step 3" in err
    assert f"resume with: pith-train pretrain {' '.join(micro_args)} --run-dir {run}" in err
    # stderr is not a terminal here: one text line per step, in the format the README documents
    lines = [line for line in err.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/6", "2/6", "3/6"]
    assert re.fullmatch(
        r"step 3/6 loss \d+\.\d{4} lr \S+ grad_norm \S+ tokens_per_s \d+ load \S+ memory_gib \S+",
        lines[2],
    )
    assert float(lines[0].split()[3]) == pytest.approx(reference[1], abs=1e-4)
    assert [p.name for p in checkpoint.checkpoints(run / "checkpoints")] == ["step_000002", "step_000003"]
    monkeypatch.undo()
    pretrain(micro_config(), run)
    assert _losses(run) == reference


SIGINT_TWICE_AT_STEP_3 = """
import os, signal, sys, time
import pith_train.train as train
real_step, count = train.train_step, [0]
def step_then_signal(*args):
    count[0] += 1
    if count[0] == 3:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.2)
        os.kill(os.getpid(), signal.SIGINT)
    return real_step(*args)
train.train_step = step_then_signal
from pith_train.cli import main
main(sys.argv[1:])
"""


def test_ctrl_c_asks_to_stop_and_a_second_one_exits_at_once(micro_args, tmp_path, subprocess_env):
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", SIGINT_TWICE_AT_STEP_3, "pretrain", "--run-dir", str(run), *micro_args],
        env=subprocess_env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == -signal.SIGINT, proc.stderr[-3000:]
    assert "SIGINT: finishing this step, then saving a checkpoint" in proc.stderr
    assert [p.name for p in checkpoint.checkpoints(run / "checkpoints")] == ["step_000002"]


def test_fp8_pretrain_runs_the_fp8_gemms_and_the_loss_falls(micro_config, reference, tmp_path, capsys):
    """train.fp8 on CPU (torch's CPU _scaled_mm, the grouped GEMM's dequantised loop): it learns, and
    differs from the fp32 run by the FP8 rounding only: step 1 close, not equal. train.fp8_all_gather
    on one process, where FSDP shards nothing, says that it has nothing to do."""
    cfg = micro_config("--train.fp8=true", "--train.steps=12", "--train.fp8_all_gather=true")
    out = pretrain(cfg, tmp_path)
    assert "train.fp8_all_gather: no FP8 weight is sharded by FSDP" in capsys.readouterr().out
    losses = _losses(tmp_path)
    assert out["step"] == 12 and losses[12] < losses[1] - 1.0
    assert losses[1] != reference[1] and abs(losses[1] - reference[1]) < 0.05


def test_fp8_sizes_the_gpu_gemms_refuse_are_named_before_anything_is_built():
    """On CUDA the FP8 GEMMs take multiples of 16: the default tiny MoE's 260-word vocabulary fails only
    with the FP8 lm_head, a padded one passes, and a micro-batch's token count is checked too."""
    cfg = load_config(None, ["train.fp8=true"])
    model_cfg = model_config(cfg.model)
    assert fp8_size_problems(cfg, model_cfg) == []
    lm = load_config(None, ["train.fp8=true", "train.fp8_lm_head=true"])
    assert fp8_size_problems(lm, model_cfg) == [
        f"lm_head.weight ({model_cfg.vocab_size}, {model_cfg.hidden_size})"
    ]
    padded = load_config(None, ["train.fp8_lm_head=true", "model.vocab_size=272"])
    assert fp8_size_problems(padded, model_config(padded.model)) == []
    odd = load_config(
        None, ["train.fp8=true", "data.seq_len=100", "train.micro_batch=1", "train.global_batch=1"]
    )
    assert fp8_size_problems(odd, model_config(odd.model)) == ["100 tokens a micro-batch"]
    assert fp8_size_problems(load_config(None, []), model_cfg) == []


def test_with_the_aux_losses_off_micro_batches_train_like_one_batch_every_time(micro_config, tmp_path):
    """Gradient accumulation over 4 micro-batches with no aux-loss gradient (lbl and z-loss 0)
    gives the one-batch losses, in repeated runs (a stale aux-loss seed once corrupted some of them)."""
    off = ["--train.lbl_coef=0", "--train.z_loss_coef=0", "--optim.eps=1e-3", "--train.steps=4"]
    pretrain(micro_config(*off, "--train.micro_batch=4"), tmp_path / "whole")
    whole = _losses(tmp_path / "whole")
    for i in range(3):
        run = tmp_path / f"micro{i}"
        pretrain(micro_config(*off, "--train.micro_batch=1"), run)
        assert _losses(run) == pytest.approx(whole, rel=1e-5)


def test_unaligned_validation_windows_validate_as_aligned_ones(micro_config, tmp_path):
    """3 validation windows in micro-batches of 2 pad the last batch (ignored labels): the padding once
    wrote -100 into its inputs too (IndexError in the embedding). The losses equal micro-batches of 1."""
    val = ["--data.val_windows=3", "--train.steps=2", "--optim.eps=1e-3"]  # one validation: fp32 noise

    for micro in (1, 2):
        pretrain(micro_config(*val, f"--train.micro_batch={micro}"), tmp_path / f"m{micro}")
    rows = [
        {
            r["step"]: r["val_loss"]
            for r in map(json.loads, (tmp_path / d / "metrics.jsonl").open())
            if "val_loss" in r
        }
        for d in ("m1", "m2")
    ]
    assert sorted(rows[0]) == [2] and rows[1] == pytest.approx(rows[0], rel=1e-5)


def test_a_failing_validation_keeps_the_trained_step_checkpointed_and_logged(
    micro_config, tmp_path, monkeypatch
):
    def broken(*args):
        raise RuntimeError("validation broke")

    monkeypatch.setattr(train, "evaluate", broken)
    with pytest.raises(RuntimeError, match="validation broke"):
        pretrain(micro_config("--log.eval_every=2"), tmp_path)
    assert [p.name for p in checkpoint.checkpoints(tmp_path / "checkpoints")] == ["step_000002"]
    assert sorted(_losses(tmp_path)) == [1, 2]


@pytest.mark.distributed
def test_a_local_launch_stops_like_one_process_on_ctrl_c(micro_args, tmp_path, subprocess_env):
    """`pretrain --nproc-per-node 2` (dp2, gloo): Ctrl-C (SIGINT to the whole process group, as a
    terminal sends it; the launcher forwards its copy, as it forwards a scheduler's SIGTERM sent to it
    alone): both ranks save the same step once, the status is 130, no traceback, and the hint is the
    launch line itself."""
    signum = signal.SIGINT
    run, args = (
        tmp_path / "run",
        [*micro_args, "--train.steps=300", "--parallel.dp=2", "--train.micro_batch=1"],
    )
    command = [
        sys.executable,
        "-m",
        "pith_train",
        "pretrain",
        "--nproc-per-node",
        "2",
        *args,
        "--run-dir",
        str(run),
    ]
    proc = subprocess.Popen(
        command, env=subprocess_env, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    while not (run / "metrics.jsonl").is_file() or len((run / "metrics.jsonl").read_text().splitlines()) < 2:
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.2)
    os.killpg(proc.pid, signum)
    err = proc.stderr.read()
    assert proc.wait() == 128 + signum, err
    assert "Traceback" not in err and err.count("resume with:") == 1
    hint = f"resume with: pith-train pretrain --nproc-per-node 2 {' '.join(args)} --run-dir {run}"
    assert hint in err and f"stopped by {signal.Signals(signum).name}" in err
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [p.name for p in checkpoint.checkpoints(run / "checkpoints")][-1] == f"step_{steps[-1]:06d}"
    assert err.count("saving a checkpoint") <= 2  # one note per rank that saw the signal


def test_the_resume_hint_under_torchrun_is_its_launch_line(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert stopping.resume_command(["c.toml", "--run-dir", "r"]) == (
        "torchrun --nproc-per-node 8 -m pith_train pretrain c.toml --run-dir r"
    )
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert stopping.resume_command(["--run-dir", "r"]).startswith(
        "torchrun --nnodes 2 '<your rendezvous flags>' --nproc-per-node 4 -m pith_train"
    )


@pytest.mark.parametrize(
    "n, why",
    [
        ("0", "must be >= 1, got 0"),
        ("-1", "must be >= 1, got -1"),
        ("4", "4: the layout pp*dp*cp*ep is 1; give"),
    ],
)
def test_a_local_launch_must_start_the_layouts_processes(micro_args, tmp_path, capsys, n, why):
    with pytest.raises(SystemExit) as e:
        main(["pretrain", "--nproc-per-node", n, *micro_args, "--run-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 1 and f"--nproc-per-node {why}" in err
    assert n != "4" or "give --nproc-per-node 1 or --parallel.pp/dp/cp/ep of 4" in err


@pytest.mark.distributed
def test_a_local_launch_whose_workers_fail_exits_with_their_status(micro_args, tmp_path, subprocess_env):
    args = [*micro_args, "--parallel.dp=2", "--train.micro_batch=1", f"--data.path={tmp_path / 'nope'}"]
    command = [sys.executable, "-m", "pith_train", "pretrain", "--nproc-per-node", "2", *args]
    done = subprocess.run([*command, "--run-dir", str(tmp_path / "run")], env=subprocess_env, timeout=300)
    assert done.returncode == 1


def test_init_from_needs_a_runs_checkpoint_with_the_same_optimizer(micro_config, micro_hf, tmp_path):
    pretrain(micro_config("--train.steps=2"), tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    with pytest.raises(ValueError, match="holds adamw's optimizer state: set optim.name=adamw"):
        pretrain(micro_config(f"--checkpoint.init_from={ckpt}", "--optim.name=muon"), tmp_path / "a")
    main(["convert", str(micro_hf), str(tmp_path / "converted")])
    with pytest.raises(ValueError, match=f"is weights only .*: use --model.name={tmp_path}"):
        pretrain(micro_config(f"--checkpoint.init_from={tmp_path / 'converted'}"), tmp_path / "b")


def test_a_launch_that_stopped_before_its_first_step_may_start_again(micro_config, tmp_path, monkeypatch):
    """TensorBoard's event file is written at the launch: alone, it is no run's history."""
    monkeypatch.setattr(train, "train_step", lambda *a: (_ for _ in ()).throw(MemoryError("no memory")))
    with pytest.raises(MemoryError):
        pretrain(micro_config("--log.tensorboard=true"), tmp_path)
    assert list((tmp_path / "tensorboard").glob("events.*")) and not (tmp_path / "metrics.jsonl").exists()
    monkeypatch.undo()
    assert pretrain(micro_config(), tmp_path)["step"] == 6


@pytest.fixture(scope="module")
def blend(micro_config, byte_data, tmp_path_factory):
    """Two sources at 0.75 and 0.25, validated on held-out windows of each: (its overrides, the
    uninterrupted run's directory, what it printed)."""
    root = tmp_path_factory.mktemp("blend")
    prepare(stdlib_corpus()[3:4], str(root / "code"), "byte", progress=False, workers=1)
    overrides = [f"--data.path={byte_data},{root / 'code'}", "--data.weights=0.75,0.25", "--log.eval_every=3"]
    printed = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train.tqdm, "write", staticmethod(lambda text, **_: printed.append(text)))
        pretrain(micro_config(*overrides), root / "straight")
    return overrides, root / "straight", "\n".join(printed)


def test_two_sources_train_at_their_weights_with_the_mix_printed_logged_and_resumed_exactly(
    micro_config, blend, tmp_path
):
    overrides, straight, printed = blend
    rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    taken = [round(r["mix/bytes"] * 4 * r["step"]) for r in rows]  # bytes' sequences so far, 4 a step
    assert [r["mix/bytes"] + r["mix/code"] for r in rows] == [1.0] * 6 and 12 <= taken[-1] <= 24
    assert f"data bytes: {taken[-1]} sequences in 6 steps" in printed
    mix = f"realised mix: {{'bytes': {taken[-1]}, 'code': {24 - taken[-1]}}} sequences, weights [0.75, 0.25]"
    assert mix in printed
    for r in (rows[2], rows[5]):  # the validation steps: each source's loss, and their weighted mean
        assert r["val_loss"] == pytest.approx(0.75 * r["val_loss/bytes"] + 0.25 * r["val_loss/code"])
    pretrain(micro_config(*overrides), tmp_path, stop_at=3)
    pretrain(micro_config(*overrides), tmp_path)
    assert _losses(tmp_path) == _losses(straight)
    again = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["mix/bytes"] for r in again] == [r["mix/bytes"] for r in rows]


@pytest.mark.distributed
def test_two_sources_train_in_the_same_order_under_two_data_ranks(
    micro_args, blend, tmp_path, pretrains_in_ranks
):
    overrides, straight, _ = blend
    pretrains_in_ranks(
        2, [(tmp_path / "dp2", [*micro_args, *overrides, "--parallel.dp=2", "--train.micro_batch=1"])]
    )
    rows = [json.loads(line) for line in (tmp_path / "dp2" / "metrics.jsonl").read_text().splitlines()]
    want = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [r["mix/code"] for r in rows] == [r["mix/code"] for r in want]
    assert [sorted(r) for r in rows] == [sorted(r) for r in want]  # validation at the same steps
    for key in ("loss", "val_loss", "val_loss/bytes", "val_loss/code"):
        got = [r[key] for r in rows if key in r]
        assert got == pytest.approx([r[key] for r in want if key in r], rel=1e-5), key


def test_a_built_in_corpus_run_resumed_with_another_tokenizer_names_it(
    micro_config, chat_tokenizer, tmp_path
):
    """It was refused as `data.path [] -> [] (other data there)`: the right refusal, the key unnamed."""
    pretrain(micro_config("--data.path=", "--train.steps=2"), tmp_path)
    with pytest.raises(ValueError, match=r"data.path \['built-in, byte'\] -> \['built-in, .*chat_tokenizer"):
        pretrain(
            micro_config("--data.path=", "--train.steps=2", f"--data.tokenizer={chat_tokenizer}"), tmp_path
        )


def test_a_checkpoint_carries_its_tokenizer_byte_for_byte(micro_config, chat_tokenizer, tmp_path, capsys):
    """A CRLF tokenizer.json came back from the checkpoint (and its export) with LF line ends: another
    hash, so eval refused the run's own dataset and --tokenizer naming the original was refused too."""
    tok = tmp_path / "tok"
    shutil.copytree(chat_tokenizer, tok)
    (tok / "tokenizer.json").write_bytes((tok / "tokenizer.json").read_bytes().replace(b"\n", b"\r\n"))
    prepare(stdlib_corpus()[3:4], str(tmp_path / "ds"), str(tok), progress=False, workers=1)
    cfg = micro_config(f"--data.path={tmp_path / 'ds'}", f"--data.tokenizer={tok}", "--train.steps=1")
    ckpt = f"{pretrain(cfg, tmp_path / 'run')['checkpoints']}/step_000001"
    main(["convert", ckpt, str(tmp_path / "hf")])
    for path in (ckpt, tmp_path / "hf"):
        assert (tok / "tokenizer.json").read_bytes() == (Path(path) / "tokenizer.json").read_bytes()
    main(["eval", ckpt, "--data", str(tmp_path / "ds"), "--max-windows", "2"])
    assert "loss" in capsys.readouterr().out
