import json
import math
import subprocess
import sys

import pith_models
import pytest
import torch
from pith_engine import checkpoint
from pith_engine.contract import Routing
from pith_train.config import load_config
from pith_train.optim import build_optimizer, lr_at
from pith_train.train import flops_per_token, moe_aux, pretrain, update_expert_bias


def _losses(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}  # a re-logged step keeps its latest value


@pytest.fixture(scope="module")
def reference(micro_config, tmp_path_factory):
    """Per-step losses of the uninterrupted 6-step run."""
    run = tmp_path_factory.mktemp("reference")
    out = pretrain(micro_config(), run)
    losses = _losses(run)
    assert out["step"] == 6 and sorted(losses) == list(range(1, 7))
    return losses


def test_stop_and_resume_reproduces_the_uninterrupted_losses_exactly(micro_config, reference, tmp_path):
    assert reference[6] < reference[1] - 0.3  # it learns
    run = tmp_path / "resumed"
    pretrain(micro_config(), run, stop_at=3)
    assert [p.name for p in checkpoint.checkpoints(run / "checkpoints")] == ["step_000002", "step_000003"]
    pretrain(micro_config(), run)
    assert _losses(run) == reference  # exact equality, fp32 on CPU
    assert [p.name for p in checkpoint.checkpoints(run / "checkpoints")] == ["step_000004", "step_000006"]


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
    # An infinite learning rate turns the weights into inf/nan at the first update.
    cfg = micro_config("--train.lr=inf", "--checkpoint.every=1")
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
        (["--data.tokenizer={tmp}/tokenizer.json"], "was made with tokenizer byte"),
        (["--model.name={tmp}"], "needs a config.json"),
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


def _routing(T: int, E: int, K: int, seed: int) -> Routing:
    g = torch.Generator().manual_seed(seed)
    logits_TE = torch.randn(T, E, generator=g, dtype=torch.float64)
    probs_TE = logits_TE.softmax(-1)
    ids_TK = probs_TE.topk(K, -1).indices
    return Routing(torch.zeros(T, 1), ids_TK, probs_TE.gather(1, ids_TK), probs_TE, logits_TE)


def test_aux_losses_match_their_definitions():
    cfg = load_config(None, ["--train.lbl_coef=0.3", "--train.z_loss_coef=0.2"])
    T, E, K = 12, 5, 2
    routings = [_routing(T, E, K, s) for s in range(3)]
    aux, counts_LE = moe_aux(routings, cfg, T, None)
    expected = 0.0
    for r in routings:
        f = [float((r.expert_ids_TK == e).sum()) / (T * K) for e in range(E)]
        P = [float(r.probs_TE[:, e].sum()) / T for e in range(E)]
        lbl = E * sum(fe * pe for fe, pe in zip(f, P))
        z = sum(float(torch.logsumexp(row, 0)) ** 2 for row in r.logits_TE) / T
        expected += (0.3 * lbl + 0.2 * z) / len(routings)
    assert math.isclose(float(aux), expected, rel_tol=1e-6)
    assert counts_LE.sum(1).tolist() == [T * K] * 3
    # Two data ranks, each with half the tokens, divide by the whole micro-batch's token count: their
    # z-loss shares add up to the whole (the load-balancing part also needs the all-reduced counts,
    # which the multi-process tests cover).
    halves = [
        Routing(r.x_TD[sl], r.expert_ids_TK[sl], r.weights_TK[sl], r.probs_TE[sl], r.logits_TE[sl])
        for r in routings
        for sl in (slice(0, T // 2), slice(T // 2, T))
    ]
    cfg_z = load_config(None, ["--train.lbl_coef=0", "--train.z_loss_coef=1"])
    whole = float(moe_aux(routings, cfg_z, T, None)[0])
    parts = float(moe_aux(halves[0::2], cfg_z, T, None)[0] + moe_aux(halves[1::2], cfg_z, T, None)[0])
    assert math.isclose(whole, parts, rel_tol=1e-6)  # fp32 logsumexp


def test_expert_bias_moves_toward_balance():
    bias = torch.zeros(4)
    update_expert_bias([bias], torch.tensor([[10.0, 2.0, 4.0, 0.0]]), rate=0.01)
    assert bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.01])


def test_flops_per_token_counts_active_weights_and_attention(micro_hf):
    model = pith_models.from_pretrained(micro_hf)
    D, F, E, K, L, H, G, Dh = 32, 16, 4, 2, 2, 2, 1, 16
    attn_w = D * H * Dh * 2 + D * G * Dh * 2  # q, o, k, v
    per_layer = attn_w + D * E + K * 3 * D * F  # router, K of E SwiGLU experts
    n_active = L * per_layer + 260 * D  # + lm_head (the embedding lookup is free)
    assert flops_per_token(model, 32) == 6 * n_active + 6 * L * 32 * H * (Dh + Dh)


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
