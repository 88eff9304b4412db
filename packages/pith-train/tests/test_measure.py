"""`pith-train plan --measure` (pith_train.measure): a rank played on one process with the other ranks
mirrored holds the tensors the same rank of a real gloo run holds, and peaks within 10% of it."""

import json
from pathlib import Path

import pytest

BASE = ["model.name=qwen3-moe-tiny", "data.seq_len=32", "train.global_batch=8", "train.micro_batch=2",
        "train.device=cpu"]  # fmt: skip
LAYOUTS = {  # name -> (world, overrides)
    "dp2": (2, ["parallel.dp=2"]),
    "ep2": (2, ["parallel.ep=2"]),
    "cp2": (2, ["parallel.cp=2"]),
    "pp2": (2, ["parallel.pp=2", "model.num_hidden_layers=4"]),
    "pp2xep2": (4, ["parallel.pp=2", "parallel.ep=2", "model.num_hidden_layers=4", "train.global_batch=16"]),
}


@pytest.mark.distributed
def test_a_mirrored_rank_holds_what_the_real_rank_holds_and_peaks_within_10_percent(run_ranks, tmp_path):
    script = Path(__file__).with_name("measures.py")
    runs = {name: {"name": name, "argv": BASE + o} for name, (_, o) in LAYOUTS.items()}
    for world in (2, 4):
        real = [json.dumps(r) for name, r in runs.items() if LAYOUTS[name][0] == world]
        run_ranks(script, world, tmp_path, *real)
    run_ranks(
        script,
        1,
        tmp_path,
        *(json.dumps({**r, "name": f"mirror-{n}", "mirror": True}) for n, r in runs.items()),
    )
    for name in LAYOUTS:
        (mirror_file,) = tmp_path.glob(f"mirror-{name}.*.json")
        rank = mirror_file.name.split(".")[1]
        mirror, real = (
            json.loads(mirror_file.read_text()),
            json.loads((tmp_path / f"{name}.{rank}.json").read_text()),
        )
        assert mirror["held"] == real["held"], name
        dynamic = [r["peak"] - r["static"] for r in (mirror, real)]
        print(name, rank, dynamic, mirror["plan"])
        assert 0.9 <= dynamic[0] / dynamic[1] <= 1.1, (name, dynamic)


def test_plan_measure_prints_measured_beside_planned(capsys):
    import torch.distributed as dist
    from pith_train.cli import main

    main(["plan", *(f"--{o}" for o in BASE), "--parallel.ep=2", "--measure", "--rank=1", "--steps=1"])
    assert not dist.is_initialized()  # the command leaves its mirrored group
    out = capsys.readouterr().out
    assert "rank 1 (pipeline rank 0) measured on cpu, the other ranks mirrored" in out, out
    assert [line.split()[1:] for line in out.splitlines() if line.startswith("  parameters")][0][0] == (
        [line.split()[1:] for line in out.splitlines() if line.startswith("  parameters")][0][1]
    ), out
    assert "step without communication" in out


def test_a_mirrored_ep_rank_receives_its_own_experts_entries_as_the_counts_say(capsys):
    """Top-3 over ep2: a token with two experts here and one there goes out in two rows. The mirror
    handed every row sent back, so this rank took more entries of its own experts than the exchanged
    counts allow: on CPU moe_permute's `rows` check, on CUDA writes past the buffer."""
    from pith_train.cli import main

    flags = [*(f"--{o}" for o in BASE), "--parallel.ep=2", "--model.num_experts_per_tok=3"]
    main(["plan", *flags, "--measure", "--rank=1", "--steps=1"])
    assert "step without communication" in capsys.readouterr().out


def test_plan_measure_runs_muon_whose_all_to_all_receives_more_than_it_sends(capsys):
    import torch.distributed as dist
    from pith_train.cli import main

    # Muon under dp2 gathers whole matrices from FSDP pieces of unequal sizes
    main(
        ["plan", *(f"--{o}" for o in BASE), "--parallel.dp=2", "--optim.name=muon", "--measure", "--steps=1"]
    )
    assert not dist.is_initialized()
    assert "step without communication" in capsys.readouterr().out


def test_plan_measure_loads_a_pith_checkpoint_under_dp2(capsys, tmp_path):
    import pith_models
    import torch.distributed as dist
    from pith_engine import checkpoint
    from pith_train.cli import main

    model = pith_models.build(pith_models.MODELS["qwen3-moe-tiny"], "cpu", 1)
    checkpoint.save(tmp_path / "step_1", model, files={"config.json": json.dumps(model.cfg.to_hf())})
    # DCP's load plan is gathered to rank 0 and scattered back: mirrored, the rank reads alone
    main(["plan", *(f"--{o}" for o in BASE[1:]), f"--model.name={tmp_path / 'step_1'}", "--parallel.dp=2",
          "--measure", "--steps=1"])  # fmt: skip
    assert not dist.is_initialized()
    assert "step without communication" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, why",
    [(["--rank=2"], "expected a rank 0 to 1"), (["--rank=-1"], "expected a rank 0 to 1"),
     (["--steps=0"], "--steps must be >= 1, got 0")],
)  # fmt: skip
def test_plan_measure_refuses_a_rank_outside_the_layout_before_it_builds(capsys, flags, why):
    from pith_train.cli import main

    with pytest.raises(SystemExit) as e:
        main(["plan", *(f"--{o}" for o in BASE), "--parallel.ep=2", "--measure", *flags])
    assert e.value.code == 1 and why in capsys.readouterr().err
    import torch.distributed as dist

    assert not dist.is_initialized()


def test_plan_measure_refuses_a_rank_the_plan_says_does_not_fit_before_it_builds(capsys, monkeypatch):
    """It built the model and was killed by the OOM killer: the DeepSeek preset at 4,096 tokens on a
    24 GiB CPU machine (the plan: 23.9 GiB)."""
    import torch.distributed as dist
    from pith_train import plan, train
    from pith_train.cli import main

    monkeypatch.setattr(plan, "device_memory", lambda device, processes=1: (2**20, "a 1 MiB device"))
    monkeypatch.setattr(train, "build_model", lambda *a, **k: pytest.fail("built a rank that does not fit"))
    with pytest.raises(SystemExit) as e:
        main(["plan", *(f"--{o}" for o in BASE), "--parallel.ep=2", "--measure", "--rank=1", "--steps=1"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and "plan: a rank of this run needs" in err, err
    assert "a 1 MiB device is 0.0 GiB" in err
    assert not dist.is_initialized()


def test_plan_measure_packs_documents_when_the_config_masks_them(capsys, monkeypatch):
    """With data.document_mask the rank attends within documents (the positions restart), as the run
    does: it ran plain causal attention over the window."""
    from pith_train import measure
    from pith_train.cli import main

    seen, step = [], measure.train_step
    monkeypatch.setattr(measure, "train_step", lambda s, o, mb, *a: seen.append(mb) or step(s, o, mb, *a))
    flags = ["--data.document_mask=true", "--data.seq_len=512"]  # documents' median: 330 tokens
    main(["plan", *(f"--{o}" for o in BASE), *flags, "--measure", "--steps=1"])
    assert "step without communication" in capsys.readouterr().out
    assert len(seen) == 2 and all(len(m) == 3 for micro in seen for m in micro)  # ids, labels, positions
    positions = [m[2] for micro in seen for m in micro]
    assert all(p.shape == (2, 512) for p in positions) and any((p[:, 1:] == 0).any() for p in positions)


def test_measure_called_as_a_library_takes_down_the_mirrored_group_it_made():
    """The CLI took it down, a direct caller of measure() was left with it: its next init failed."""
    import torch.distributed as dist
    from pith_train.config import load_config
    from pith_train.measure import measure

    cfg = load_config(None, BASE + ["parallel.ep=2"])
    try:
        assert measure(cfg, 1, steps=1)["rank"] == 1
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():  # the next test's group
            dist.destroy_process_group()


def test_the_mirror_answers_a_barrier():
    import torch.distributed as dist
    from pith_train.measure import BACKEND

    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=1, world_size=2)
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "model, tied",  # a tied embedding stays in the root unit with lm_head (FSDP refused it in two)
    [("qwen3-moe-tiny", False), ("deepseek-v2-tiny", False), ("gpt-oss-tiny", False), ("gpt-oss-tiny", True)],
)
def test_each_fsdp_unit_reduces_gradients_of_one_dtype_with_bf16_weights(monkeypatch, model, tied):
    """torch 2.11's FSDP refuses to reduce a unit whose gradients mix bf16 and fp32 ("FSDP reduce-scatter
    expects uniform gradient dtype"): every 8-GPU preset (one micro-batch) stopped at its first step on
    an H100, its root unit holding the final norm's and lm_head's gradients, accumulated in fp32 since
    the first backward segment, beside the embedding's, fresh in bf16 from the last. CPU runs fp32
    weights (and newer torch reduces mixed groups): here a mirrored dp2 x ep2 rank of the trainer's
    parts has bf16 weights and stream, as on CUDA; the spy sees what FSDP reduces."""
    import torch
    import torch.distributed as dist
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as group
    from pith_engine.step import Stages, train_step
    from pith_train import train
    from pith_train.config import load_config
    from pith_train.measure import BACKEND
    from pith_train.optim import build_optimizer

    reduce, seen = group.foreach_reduce, []

    def spy(params, grads, *args, **kwargs):
        seen.append({p._param_fqn: g.dtype for p, g in zip(params, grads)})
        return reduce(params, grads, *args, **kwargs)

    monkeypatch.setattr(group, "foreach_reduce", spy)
    overrides = [f"model.name={model}", f"model.tie_word_embeddings={str(tied).lower()}"]
    cfg = load_config(None, [*BASE[1:], *overrides, "parallel.dp=2", "parallel.ep=2"])
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=0, world_size=4)
    try:
        mesh = train.parallel_layout(cfg, torch.device("cpu"))
        model = train.build_model(cfg.model, mesh.device, 0, mesh, torch.bfloat16, True)
        assert (model.lm_head.weight is model.embed_tokens.weight) == tied
        stages = Stages(model, mesh, dtype=torch.bfloat16)
        ids = torch.randint(model.cfg.vocab_size, (2, 33))
        micro = [(ids[:, :-1], ids[:, 1:])]  # one micro-batch: no accumulation evens the dtypes out
        train_step(stages, build_optimizer(model, cfg), micro, 1e-3, *train.step_settings(cfg, model))
    finally:
        dist.destroy_process_group()
    mixed = [dtypes for dtypes in seen if len(set(dtypes.values())) > 1]
    assert seen and not mixed, mixed


@pytest.mark.gpu
def test_plan_measure_runs_fsdp_and_ep_on_cuda(capsys):
    """A mirrored dp2 x ep2 rank on CUDA (bf16 weights, this torch's FSDP), as measure_presets.py plays the
    8-GPU presets' ranks: torch 2.11 refused their mixed-dtype reduction before the embedding's own unit."""
    from pith_train.cli import main

    flags = [f"--{o}" for o in BASE[:-1]] + ["--parallel.dp=2", "--parallel.ep=2", "--train.global_batch=4"]
    main(["plan", *flags, "--train.micro_batch=1", "--measure", "--steps=1"])
    assert "step without communication" in capsys.readouterr().out


def test_a_mirrored_rank_gathers_a_router_whose_experts_score_apart(monkeypatch):
    """FSDP shards the router over dp x ep: gathered as copies of this rank's rows, experts e, e + 2, ...
    scored alike, and CUDA's top-k took the lowest ids of the ties. On an H100 the DeepSeek preset's
    rank 0 received 1.33 of an even load and rank 7 none (peaks 77 and 44 GiB, held tensors equal)."""
    from pith_train import measure, train
    from pith_train.config import load_config

    gathered, hooks, build, train_step = [], [], train.build_model, measure.train_step

    def spied(*args):
        model = build(*args)
        for router in [layer.router for layer in model.layers.values() if layer.router is not None]:
            hooks.append(router.register_forward_pre_hook(lambda m, i: gathered.append(m.weight.clone())))
        return model

    def step(*args):  # the warm-up step's: the timed one counts what its ops allocate
        train_step(*args)
        [hook.remove() for hook in hooks]

    monkeypatch.setattr(train, "build_model", spied)
    monkeypatch.setattr(measure, "train_step", step)
    overrides = ["parallel.ep=4", "model.num_experts=8", "train.compile=false"]
    measure.measure(load_config(None, BASE + overrides), 3, steps=1)
    assert gathered and all(w.shape[0] == 8 and w.unique(dim=0).shape[0] == 8 for w in gathered), gathered
