"""`pith-train plan` (pith_train.plan): its terms against what the trainer keeps and the bench's measured
peaks, how they scale with the layout and the settings, what it prints; and the check `pretrain` and
`bench` run with it: a run that cannot fit, or a layout for more processes than were started, stops
before anything is built, saying why (the presets against their cards: test_configs.py).

Shape legend: B sequences, S sequence length.
"""

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pith_models
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pith_engine import parallel
from pith_engine.schedule import Action, Op
from pith_engine.step import Aux, Stages, _Run
from pith_train import plan
from pith_train.cli import main
from pith_train.config import load_config, model_config
from pith_train.train import pretrain

ROOT = Path(__file__).resolve().parents[3]
SHAPES = {name: plan.model_shape(pith_models.MODELS[name]) for name in ("qwen3-moe-tiny", "qwen3-30b-a3b")}


def kept_bytes(name: str, B: int, S: int, ac: str) -> float:
    """Bytes the trainer's forward of one micro-batch keeps for its backward: the Tape's segment inputs
    and outputs and the tensors its ops save, distinct storages, less the parameters; the CPU attention's
    fp32 S x S scores included (the plan counts them on CPU only: the flash kernels on CUDA keep none)."""
    model = pith_models.build(name, "cpu")
    ids = torch.ones(B, S, dtype=torch.long)
    stages = Stages(model, parallel.SINGLE, ac=ac)
    run = _Run(stages, [(ids, ids, None, None)], torch.tensor(B * S), Aux(), True)
    seen = {}

    def keep(t):
        if t.layout == torch.strided and any(t.stride()):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        run.run([Action(Op.F, 0, 0)])
    for leaves, sources, outputs, _, _ in run.tapes[(0, 0)][0].segments:
        for t in [*leaves, *sources, *outputs]:
            keep(t)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in params)


@pytest.mark.parametrize("name", ["tiny-moe", "qwen3-moe-tiny", "deepseek-v2-tiny", "gpt-oss-tiny"])
def test_planned_activations_are_within_10_percent_of_what_the_trainer_keeps(name):
    B, S = 2, 40  # and S = 512 below, where the S x S scores dominate
    for ac in ("none", "selective", "full"):
        cfg = load_config(None, [f"model.name={name}", f"data.seq_len={S}", f"train.micro_batch={B}",
                                 f"train.global_batch={B}", f"train.ac={ac}"])  # fmt: skip
        start = plan.rank_plan(cfg, plan.model_shape(pith_models.MODELS[name]), 0, cuda=False)[0]
        measured = kept_bytes(name, B, S, ac)
        assert 0.9 <= start.terms["activations"] / measured <= 1.1, (  # measured: 0.93-1.07
            ac,
            start.terms["activations"],
            measured,
        )


def _plan(name: str, *overrides: str, cuda: bool = True) -> plan.Plan:
    cfg = load_config(None, [f"model.name={name}", *overrides])
    return plan.plan(cfg, SHAPES[name], cuda)


@settings(max_examples=12, deadline=None)
@given(
    name=st.sampled_from(sorted(SHAPES)),
    dp=st.sampled_from([1, 2, 4]),
    ep=st.sampled_from([1, 2, 4]),
    micro=st.sampled_from([1, 2]),
    ac=st.sampled_from(["none", "selective", "full"]),
    fp8=st.booleans(),
    cuda=st.booleans(),
)
def test_plan_terms_scale_with_the_layout_and_settings(name, dp, ep, micro, ac, fp8, cuda):
    n = pith_models.param_count(pith_models.build(name))
    batch = ["data.seq_len=64", f"train.micro_batch={micro}", f"train.global_batch={micro * 2 * dp * ep}"]
    args = [*batch, f"parallel.ep={ep}", f"train.ac={ac}", f"train.fp8={fp8}".lower()]
    one, two = (_plan(name, *args, f"parallel.dp={d}", cuda=cuda) for d in (dp, 2 * dp))
    assert one.total == pytest.approx(sum(one.terms.values()))
    # Every parameter lives on one of the dp*ep ranks of the (dense) layout: fp32 masters and AdamW's two
    # fp32 moments, 4 and 8 bytes each; doubling dp halves both.
    assert one.terms["parameters"] * dp * ep == pytest.approx(4 * n, rel=0.02)
    for term in ("parameters", "optimizer state"):
        assert two.terms[term] == pytest.approx(one.terms[term] / 2)

    # Recompute keeps less: full < selective < none, at the start of the backward.
    def acts(ac: str) -> float:
        cfg = load_config(None, [f"model.name={name}", *args, f"parallel.dp={dp}", f"train.ac={ac}"])
        return plan.rank_plan(cfg, SHAPES[name], 0, cuda)[0].terms["activations"]

    assert acts("full") < acts("selective") < acts("none")
    # FP8 copies are kept only of weights no FSDP shards (one rank: all; its eager projections too).
    eager = [*args, "parallel.dp=1", "parallel.ep=1", "train.compile=false", "train.global_batch=2"]
    bf16, fp8_run = (_plan(name, *eager, f"train.fp8={f}", cuda=cuda) for f in ("false", "true"))
    assert fp8_run.terms["weight copies"] > bf16.terms["weight copies"]
    assert (bf16.terms["weight copies"] > 0) == cuda  # bf16 casts on CUDA; fp32 compute on CPU casts nothing


def test_the_plan_of_the_bench_workload_is_within_5_percent_of_its_measured_peak():
    """pith-train README: the bench (BF16, no recompute) peaked at 52.1 GiB allocated on an H200 and an
    H100; FP8 + FP8 lm_head at 51.6."""
    bench = load_config(str(ROOT / "configs" / "bench-qwen3-4layers-1gpu.toml"))
    m = plan.model_shape(model_config(bench.model))
    for overrides, measured in [([], 52.1), (["--train.fp8=true", "--train.fp8_lm_head=true"], 51.6)]:
        cfg = load_config(str(ROOT / "configs" / "bench-qwen3-4layers-1gpu.toml"), overrides)
        assert plan.plan(cfg, m, cuda=True).total / plan.GIB == pytest.approx(measured, rel=0.05)


def test_plan_prints_the_terms_and_the_nearest_changes_that_fit(capsys):
    with pytest.raises(SystemExit) as e:  # the Qwen3 preset with ac selective does not fit 79 GiB
        main(
            [
                "plan",
                str(ROOT / "configs" / "qwen3-30b-a3b-8gpu.toml"),
                "--train.ac=selective",
                "--gpu-memory=79",
            ]
        )
    out = capsys.readouterr().out
    assert e.value.code == 1 and "does not fit" in out and "activations" in out, out
    assert (
        "fits with --train.ac=full" in out and "--parallel.dp=4 --train.global_batch=16 (16 GPUs)" in out
    ), out
    main(["plan", str(ROOT / "configs" / "qwen3-30b-a3b-8gpu.toml"), "--gpus=16", "--train.global_batch=16",
          "--gpu-memory=79"])  # fmt: skip
    assert "pp 1 x dp 4 x cp 1 x ep 4" in capsys.readouterr().out


def test_a_layout_for_more_processes_names_torchrun(tmp_path):
    cfg = load_config(str(ROOT / "configs" / "qwen3-30b-a3b-8gpu.toml"))
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 8 -m pith_train pretrain CONFIG"):
        pretrain(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_run_that_cannot_fit_the_cpu_stops_within_seconds_before_it_allocates(tmp_path):
    cfg = load_config(str(ROOT / "configs" / "bench-qwen3-4layers-1gpu.toml"), ["--train.device=cpu"])
    needed = plan.plan(cfg, plan.model_shape(model_config(cfg.model)), cuda=False)
    if needed.needs < plan.device_memory(torch.device("cpu"))[0]:
        pytest.skip(f"this machine has more than the {needed.needs / plan.GIB:.0f} GiB the run needs")
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


@pytest.mark.gpu
def test_the_plan_of_two_bench_layers_is_within_10_percent_of_the_allocators_peak_on_a_card():
    from pith_train import bench

    r = bench.run(layers=2, batch=2, compile=False, steps=2, warmup=2, back_to_back=False)
    assert 0.9 <= r["plan_gib"]["total"] / r["peak_allocated_gib"] <= 1.1, r["plan_gib"]  # H100: 0.993


def test_plan_reads_a_hugging_face_directorys_config_json_only(tmp_path, capsys, monkeypatch):
    """Fine-tuning a released checkpoint: model.name a Qwen3-30B-A3B-shaped Hugging Face directory, whose
    model.safetensors here is junk and whose safetensors no reader may open: the plan is the preset's."""
    import safetensors
    from pith_models import hf

    def refuse(*args, **kwargs):
        raise AssertionError(f"plan opened safetensors {args}")

    for where in (safetensors, hf):
        monkeypatch.setattr(where, "safe_open", refuse)
    hf_dir = tmp_path / "Qwen3-30B-A3B"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(pith_models.MODELS["qwen3-30b-a3b"].to_hf()))
    (hf_dir / "model.safetensors").write_bytes(b"not read")
    preset = str(ROOT / "configs" / "qwen3-30b-a3b-8gpu.toml")
    out = []
    for name in ("qwen3-30b-a3b", str(hf_dir)):
        main(["plan", preset, f"--model.name={name}", "--gpu-memory=79"])
        out.append(capsys.readouterr().out.replace(str(hf_dir), "qwen3-30b-a3b"))
    assert out[0] == out[1] and "fits" in out[1], out


@pytest.mark.parametrize("command", ["plan", "pretrain"])
def test_a_sequence_past_the_position_limit_is_refused_for_it_not_for_memory(command, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(
            [command, "--data.seq_len=100000", "--train.device=cpu", "--run-dir", str(tmp_path / "run")][
                : 3 + 2 * (command == "pretrain")
            ]
        )
    err = capsys.readouterr().err
    assert e.value.code == 1 and "data.seq_len=100000 is more than the model's max_position_embeddings" in err
    assert not (tmp_path / "run").exists()


def test_an_8_gpu_preset_on_one_gpu_is_planned_and_the_fixes_name_more_gpus(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", str(ROOT / "configs" / "qwen3-30b-a3b-8gpu.toml"), "--gpus=1", "--gpu-memory=79"])
    out = capsys.readouterr().out
    assert e.value.code == 1 and "does not fit" in out and "pp 1 x dp 1 x cp 1 x ep 1" in out, out
    assert "fits with --parallel.dp=8 (8 GPUs)" in out, out  # the global batch kept


def test_a_tiny_model_that_cannot_fit_blames_the_fixed_overhead(monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--train.device=cuda", "--gpu-memory=0.5"])
    out = capsys.readouterr().out
    assert e.value.code == 1 and "the fixed 1 GiB a process holds (context, libraries) is most" in out, out
    monkeypatch.setattr(plan, "device_memory", lambda *a: (0.5 * plan.GIB, "a small card"))
    with pytest.raises(ValueError, match="the fixed 1 GiB a process holds") as e:
        plan.check(
            load_config(None, ["--train.device=cpu"]),
            pith_models.MODELS["tiny-moe"],
            torch.device("cpu"),
            "X",
        )
    assert "a smaller model" not in str(e.value)


def test_planned_cpu_activations_hold_the_attention_scores_where_they_dominate():
    B, S = 2, 512  # tiny-moe: the fp32 scores 2 x 4 heads x 512 x 512, two kept per layer: 16 of 19 MiB
    cfg = load_config(None, [f"data.seq_len={S}", f"train.micro_batch={B}", f"train.global_batch={B}"])
    start = plan.rank_plan(cfg, plan.model_shape(pith_models.MODELS["tiny-moe"]), 0, cuda=False)[0]
    measured = kept_bytes("tiny-moe", B, S, "none")
    assert 0.9 <= start.terms["activations"] / measured <= 1.1, (start.terms["activations"], measured)
