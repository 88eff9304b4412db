"""Pipeline parallelism trains like one process: through the engine's train_step (DualPipeV schedule,
stage-level segments, P2P between neighbours, per-layer aux losses and bias counts, FSDP reduced once
per step, the norm over every pipeline rank), tiny Qwen3-MoE, DeepSeek-V2 (a dense first layer, shared
experts) and GPT-OSS configs in fp32 reproduce the single-process per-step losses over 4 AdamW steps
(clipping, load-balancing loss, z-loss and the expert-bias update on) to a relative error <= 1e-5, and
every parameter's gradient after the first step, under pp2 (2 gloo processes), pp2 x ep2, pp2 x dp2,
pp2 x cp2 and pp4 (4 processes; 8 layers): every model under pp2 and pp2 x cp2, the others a cover
(LAYOUTS: DeepSeek-V2 under pp2 x ep2 and pp2 x dp2 is test_overlap.py's, with overlap and the
weight-gradient delay on and off); in FP8 (use_fp8) under pp2 the first step's loss and gradients
match one FP8 process as closely. Checkpoints are canonical: saved on one process and
resumed under pp2 x ep2, saved under pp2 x ep2 and resumed on one process, under ep2 and under dp2.

Each world size is spawned once (this file run as a script, one process per rank); rank 0 also runs
the single-process references. A step's global batch is [micro-batch][data rank][sequence]: the
single-process reference runs the same micro-batches whole.
"""

import dataclasses
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from pith_engine import checkpoint
from pith_engine.fp8 import use_fp8
from pith_engine.parallel import Layout, Mesh, build_mesh, held_layers, parallelize
from pith_engine.step import Aux, Stages, train_step
from pith_models import deepseek_v2, gpt_oss, qwen3_moe

# A config of L layers: Qwen3-MoE's first layer dense, DeepSeek-V2's first dense and shared experts,
# GPT-OSS's sliding-window and full attention alternating (window 5 crosses the cp2 zigzag chunks).
MODELS = {
    "qwen3_moe": (
        qwen3_moe,
        lambda L: dataclasses.replace(qwen3_moe.TINY, num_experts=8, num_hidden_layers=L),
    ),
    "deepseek_v2": (deepseek_v2, lambda L: dataclasses.replace(deepseek_v2.TINY, num_hidden_layers=L)),
    "gpt_oss": (gpt_oss, lambda L: dataclasses.replace(gpt_oss.TINY, num_hidden_layers=L, layer_types=())),
}
CHECKPOINTED = MODELS["qwen3_moe"][1]
# World size -> (layout, the models run under it). Qwen3-MoE also runs pp2 x ep2 in the checkpoint runs.
ALL = tuple(MODELS)
LAYOUTS = {
    2: [(Layout(pp=2), ALL)],
    4: [
        (Layout(pp=2, ep=2), ("gpt_oss",)),
        (Layout(pp=2, dp=2), ("qwen3_moe", "gpt_oss")),
        (Layout(pp=2, cp=2), ALL),
        (Layout(pp=4), ("qwen3_moe", "deepseek_v2")),
    ],
}
STEPS, MICRO_BATCHES, SEQ = 4, 8, 16
RESUME_AT = 2
AUX = Aux(lbl_coef=0.1, z_loss_coef=1e-3)
MAX_NORM, BIAS_RATE, ADAM_EPS = (
    0.05,
    1e-2,
    1e-3,
)  # as test_equivalence: clipping acts; eps keeps fp32 noise down
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-5, 1e-7


def batches(vocab: int, data_ranks: int):
    """Token ids and labels [STEPS, MICRO_BATCHES * data_ranks, SEQ]; about 1 label in 8 is ignored."""
    g = torch.Generator().manual_seed(3)
    shape = (STEPS, MICRO_BATCHES * data_ranks, SEQ)
    ids, labels = torch.randint(0, vocab, shape, generator=g), torch.randint(0, vocab, shape, generator=g)
    labels[torch.rand(shape, generator=g) < 0.125] = -100
    return ids, labels


def train(
    module,
    cfg,
    mesh: Mesh,
    data_ranks: int,
    steps=range(STEPS),
    load=None,
    save=None,
    fp8=False,
    **stage_flags,
):
    """-> (global loss of each step, every parameter's full gradient after the first step it runs, on this
    rank's pipeline stage only); resumes from `load` and checkpoints to `save` at the end when given.
    fp8: the projections and expert GEMMs in FP8 (use_fp8). stage_flags: Stages' overlap and wgrad (on
    by default, as in the trainer)."""
    from oracles import full_state

    from conftest import ScaledAdamW  # the worker runs as a script beside conftest.py

    model = module.Model(cfg)
    module.init_weights(model, seed=0)  # the same weights on every rank, then each keeps its share
    parallelize(model, mesh)
    use_fp8(model, fp8)
    opt = ScaledAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=ADAM_EPS, foreach=False)
    if load:
        checkpoint.load(load, model, opt, mesh)
    stages = Stages(model, mesh, **stage_flags)
    moe_layers = sum(layer.experts is not None for layer in held_layers(module.Model(cfg)).values())
    aux = AUX._replace(moe_layers=moe_layers)
    ids, labels = batches(cfg.vocab_size, data_ranks)
    lay = mesh.layout
    mb = data_ranks // lay.data_ranks  # sequences per micro-batch on this rank
    losses, grads = [], {}
    # Before the first update (every rank at once): the step's gradients, complete and reduced.
    hook = opt.register_step_pre_hook(lambda *_: grads.update(full_state(model, mesh, grads=True)))
    for step in steps:
        if step != steps[0]:
            hook.remove()
        rows = [(j * lay.data_ranks + mesh.data_rank) * mb for j in range(MICRO_BATCHES)]
        micro = [(ids[step, r : r + mb], labels[step, r : r + mb]) for r in rows]
        losses.append(train_step(stages, opt, micro, 1e-2, aux, MAX_NORM, BIAS_RATE).loss.item())
    if save:
        checkpoint.save(save, model, opt, mesh=mesh)
    return losses, grads


def assert_same_losses(losses, expected, where: str) -> None:
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, expected, strict=True)]
    assert max(rel) <= LOSS_RTOL, f"{where}: losses {losses}, single process {expected}"


def compare(losses, ref, tmp: Path, world: int | str, pp: int, where: str) -> None:
    ref_losses, ref_grads = ref
    assert_same_losses(losses, ref_losses, where)
    got = {}
    for p in range(pp):
        got.update(torch.load(tmp / f"grads_{world}_{p}.pt"))
    assert got.keys() == ref_grads.keys(), (where, sorted(got.keys() ^ ref_grads.keys()))
    rtol, atol = GRAD_RTOL, GRAD_ATOL
    bad = [n for n, g in got.items() if not torch.allclose(g, ref_grads[n], rtol=rtol, atol=atol)]
    assert not bad, f"{where}: gradients differ from the single process for {bad}"


def check_fp8_pp2(tmp: Path, rank: int, single: Mesh) -> None:
    """use_fp8 under pp2 (DualPipeV, FP8 weight gradients deferred to its W actions) against one process
    in FP8, the first step: each layer quantises the same micro-batches' rows as on one process, so the
    loss and the gradients agree to fp32 summation order (the tolerances above). After an update, an
    fp32 difference of that order can move a value across an e4m3 rounding boundary: later steps are
    test_equivalence.py's FP8 tolerances' business, not compared here."""
    module, cfg = qwen3_moe, CHECKPOINTED(4)
    if rank == 0:
        ref = train(module, cfg, single, 1, steps=range(1), fp8=True)
        fp32 = train(module, cfg, single, 1, steps=range(1))[0]
        assert abs(ref[0][0] - fp32[0]) > 1e-4 * abs(fp32[0]), (ref[0], fp32)  # FP8 did run
        torch.save(ref, tmp / "ref_fp8.pt")
    dist.barrier()
    mesh = build_mesh(Layout(pp=2), torch.device("cpu"))
    losses, grads = train(module, cfg, mesh, 1, steps=range(1), fp8=True)
    torch.save(grads, tmp / f"grads_fp8_{mesh.pp_rank}.pt")
    dist.barrier()
    if rank == 0:
        compare(losses, torch.load(tmp / "ref_fp8.pt"), tmp, "fp8", 2, "fp8 pp2")
    dist.barrier()


def _worker(world: int, rank: int, tmp: Path) -> None:
    torch.set_num_threads(1)
    store = f"file://{tmp}/store{world}"
    dist.init_process_group(
        "gloo", init_method=store, rank=rank, world_size=world, timeout=timedelta(minutes=8)
    )
    cpu = torch.device("cpu")
    single = Mesh(Layout(), cpu)
    # The single-process references: once for both world sizes, spread over the ranks of the first.
    runs = [(n, 2 * lay.pp, lay.data_ranks) for lay, names in LAYOUTS[4] + LAYOUTS[2] for n in names]
    refs = dict.fromkeys([*runs, ("qwen3_moe", 4, 2)])  # the last: the checkpoint runs'
    ref = lambda name, layers, dr: tmp / f"ref_{name}_{layers}_{dr}.pt"
    if world == 4:
        for i, (name, layers, dr) in enumerate(refs):
            if i % world == rank:
                module, config = MODELS[name]
                torch.save(train(module, config(layers), single, dr), ref(name, layers, dr))
        dist.barrier()
    for layout, names in LAYOUTS[world]:
        for name in names:
            module, config = MODELS[name]
            cfg = config(2 * layout.pp)
            dr = layout.data_ranks
            mesh = build_mesh(layout, cpu)
            losses, grads = train(module, cfg, mesh, dr)
            where = f"{name} {layout}"
            # Each pipeline stage's grads, from its first data rank, go to rank 0 through a file.
            if mesh.dp_rank == mesh.cp_rank == mesh.ep_rank == 0:
                torch.save(grads, tmp / f"grads_{world}_{mesh.pp_rank}.pt")
            dist.barrier()
            if rank == 0:
                compare(
                    losses, torch.load(ref(name, cfg.num_hidden_layers, dr)), tmp, world, layout.pp, where
                )
            dist.barrier()

    if world == 2:  # FP8 under pp2, the weight-gradient delay on: the first step as one process's
        check_fp8_pp2(tmp, rank, single)

    # Checkpoints across layouts (Qwen3-MoE, 4 layers, 2 data ranks in every run).
    module, cfg = qwen3_moe, CHECKPOINTED(4)
    expected = torch.load(ref("qwen3_moe", 4, 2))[0][RESUME_AT:]  # the uninterrupted single-process run
    if world == 4:
        one, pp_ep = tmp / "ckpt_single", tmp / "ckpt_pp2_ep2"
        if rank == 0:
            train(module, cfg, single, 2, steps=range(RESUME_AT), save=one)
        dist.barrier()
        mesh = build_mesh(Layout(pp=2, ep=2), cpu)
        resumed = train(module, cfg, mesh, 2, steps=range(RESUME_AT, STEPS), load=one)[0]
        assert_same_losses(resumed, expected, "1 process -> pp2xep2")
        train(module, cfg, mesh, 2, steps=range(RESUME_AT), save=pp_ep)
        if rank == 0:
            resumed = train(module, cfg, single, 2, steps=range(RESUME_AT, STEPS), load=pp_ep)[0]
            assert_same_losses(resumed, expected, "pp2xep2 -> 1 process")
    else:
        for layout in (Layout(ep=2), Layout(dp=2)):
            mesh = build_mesh(layout, cpu)
            load = tmp / "ckpt_pp2_ep2"
            resumed = train(module, cfg, mesh, 2, steps=range(RESUME_AT, STEPS), load=load)[0]
            assert_same_losses(resumed, expected, f"pp2xep2 -> {layout}")
    dist.destroy_process_group()


@pytest.mark.distributed
def test_pipeline_layouts_reproduce_one_process_and_checkpoints_resume_across_them(run_ranks, tmp_path):
    run_ranks(__file__, 4, tmp_path, timeout=1500)  # pp2xep2, pp2xdp2, pp2xcp2, pp4; checkpoints
    run_ranks(__file__, 2, tmp_path, timeout=900)  # pp2; the pp2xep2 checkpoint resumed under ep2, dp2


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
