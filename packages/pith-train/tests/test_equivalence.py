"""Every parallel layout trains like one process, through the trainer itself: for tiny Qwen3-MoE,
DeepSeek-V2 (MLA) and GPT-OSS (sliding window, sinks) configs with 8 experts, in fp32 on CPU, the
layouts dp2, ep2, cp2 (2 gloo processes under torchrun) and dp2 x ep2, cp2 x ep2, ep4 (4 processes)
reproduce the single-process per-step losses (cross-entropy and aux) of 5 steps of the trainer's
`train_step` (2 micro-batches, gradient clipping active, load-balancing loss, z-loss and the expert-bias
update on) to a relative 1e-5, and every parameter's (clipped) gradient of the first step.

Each model is the trainer's sharded build (pith_models.build with the layout's mesh: this rank's
experts and FSDP shards only, drawn from the seed); the layout is the trainer's own
(train.parallel_layout from a Config's [parallel]). A checkpoint written under dp2 x ep2 after 3 steps
resumes on one process and under dp2 to the uninterrupted losses. A Hugging Face directory loaded
sharded under dp2 x ep2 and ep4 (each rank reading its experts only: per-expert tensors for Qwen3-MoE,
slices of stacked ones for GPT-OSS) holds exactly the single-process load's tensors.
"""

import dataclasses
import os
import sys
from pathlib import Path

import pith_models
import pytest
import torch
import torch.distributed as dist
from pith_engine import checkpoint
from pith_engine.parallel import SINGLE, Layout, full_state
from pith_engine.step import Stages, step_values, train_step
from pith_models import deepseek_v2, gpt_oss, qwen3_moe
from pith_train import train
from pith_train.config import load_config
from pith_train.optim import build_optimizer

MODELS = {
    "qwen3_moe": dataclasses.replace(qwen3_moe.TINY, num_experts=8, mlp_only_layers=()),
    "deepseek_v2": dataclasses.replace(deepseek_v2.TINY, num_hidden_layers=2),
    # one sliding-window layer (window 5: across the cp2 zigzag chunks of 4) and one full, both with sinks
    "gpt_oss": dataclasses.replace(gpt_oss.TINY, num_hidden_layers=2, layer_types=()),
}
LAYOUTS = {
    2: [Layout(dp=2), Layout(ep=2), Layout(cp=2)],
    4: [Layout(dp=2, ep=2), Layout(cp=2, ep=2), Layout(ep=4)],
}
STEPS, GLOBAL_BATCH, MICRO_BATCHES, SEQ, LR = 5, 8, 2, 16, 1e-2
RESUME_AT = 3  # the checkpointed run stops after 3 steps; the resumed ones run steps 3 and 4
RTOL = 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-7  # gradients are O(1e-2); fp32 summation-order noise is ~1e-9
# optim.eps 1e-3: Adam divides by sqrt(v) + eps; with the default 1e-8, entries whose gradient is ~1e-8
# turn fp32 summation-order noise (~1e-9) into visible weight differences, and a near-tied top-k
# choice then flips. grad_clip 0.05 is below the first steps' gradient norms, so clipping acts.
OVERRIDES = [
    f"data.seq_len={SEQ}", f"train.global_batch={GLOBAL_BATCH}", "train.device=cpu", "train.lbl_coef=1e-2",
    "train.z_loss_coef=1e-3", "train.bias_rate=1e-2", "optim.eps=1e-3", "optim.grad_clip=0.05",
]  # fmt: skip


def batches(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels [STEPS, GLOBAL_BATCH, SEQ]; about 1 label in 8 is ignored (-100)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (STEPS, GLOBAL_BATCH, SEQ), generator=g)
    labels = torch.randint(0, vocab, (STEPS, GLOBAL_BATCH, SEQ), generator=g)
    labels[torch.rand(labels.shape, generator=g) < 0.125] = -100
    return ids, labels


def run(model_cfg, shape: Layout | None, steps=range(STEPS), load=None, save=None):
    """-> (per-step (loss, aux), every parameter's full gradient at step 0 if it ran); shape None: one
    process without groups. Resumes from checkpoint `load`, checkpoints to `save` at the end."""
    shape = shape or Layout()
    per_rank = GLOBAL_BATCH // MICRO_BATCHES // shape.data_ranks
    parallel = [f"parallel.{k}={v}" for k, v in dataclasses.asdict(shape).items()]
    cfg = load_config(None, [*OVERRIDES, f"train.micro_batch={per_rank}", *parallel])
    cpu = torch.device("cpu")
    mesh = SINGLE if shape.world == 1 else train.parallel_layout(cfg, cpu)
    model = pith_models.build(model_cfg, cpu, cfg.train.seed, mesh)
    optimizer = build_optimizer(model, cfg)
    stages, settings = Stages(model, mesh), train.step_settings(cfg, model)
    grads = {}

    def first_step_grads(*_) -> None:  # after clipping, before the update; every rank calls it
        if not grads:
            grads.update(full_state(model, mesh, grads=True))

    optimizer.register_step_pre_hook(first_step_grads)
    if load:
        checkpoint.load(load, model, optimizer, mesh)
    ids, labels = batches(model_cfg.vocab_size)
    losses = []
    for step in steps:
        rows = [(j * mesh.layout.data_ranks + mesh.data_rank) * per_rank for j in range(MICRO_BATCHES)]
        micro = [(ids[step, r : r + per_rank], labels[step, r : r + per_rank]) for r in rows]
        loss, aux, _, _ = step_values(*train_step(stages, optimizer, micro, LR, *settings))
        losses.append((loss, aux))
    if save:
        checkpoint.save(save, model, optimizer, mesh=mesh)
    return losses, grads


def assert_same_losses(losses, expected, where: str) -> None:
    for (loss, aux), (want, want_aux) in zip(losses, expected, strict=True):
        assert abs(loss - want) <= RTOL * abs(want), f"{where}: losses {losses}, single process {expected}"
        assert abs(aux - want_aux) <= RTOL * abs(want_aux), (
            f"{where}: aux {losses}, single process {expected}"
        )


def _worker(tmp: Path) -> None:
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # Resuming across layouts (below); 6 experts over ep2 x dp2 are 3 per EP rank in FSDP pieces of 2 and 1.
    cfg6 = dataclasses.replace(MODELS["qwen3_moe"], num_experts=6)
    # The single-process references (the 3 models and cfg6's uninterrupted run) once for both world
    # sizes, one per rank of the first at the same time: rank 0 alone would take 4 times as long.
    refs = {**MODELS, "cfg6": cfg6}
    if world == 4:
        for i, (name, model_cfg) in enumerate(refs.items()):
            if rank == i:
                torch.save(run(model_cfg, None), tmp / f"ref_{name}.pt")
        dist.barrier()
    for name, model_cfg in MODELS.items():
        ref = torch.load(tmp / f"ref_{name}.pt") if rank == 0 else None
        for shape in LAYOUTS[world]:
            losses, grads = run(model_cfg, shape)
            if rank != 0:
                continue
            where = f"{name} {shape}"
            assert_same_losses(losses, ref[0], where)
            assert grads.keys() == ref[1].keys(), where
            bad = [n for n, g in grads.items() if not torch.allclose(g, ref[1][n], GRAD_RTOL, GRAD_ATOL)]
            assert not bad, f"{where}: gradients differ from the single process for {bad}"

    if world == 4:
        for name in ("qwen3_moe", "gpt_oss"):
            hf_dir = tmp / f"hf_{name}"
            if rank == 0:
                pith_models.save_pretrained(pith_models.build(MODELS[name], "cpu", 1), hf_dir, torch.float32)
                whole = pith_models.from_pretrained(hf_dir).state_dict()
            dist.barrier()
            for shape in (Layout(dp=2, ep=2), Layout(ep=4)):
                cfg = load_config(
                    None,
                    [
                        *OVERRIDES,
                        "train.micro_batch=1",
                        *[f"parallel.{k}={v}" for k, v in dataclasses.asdict(shape).items()],
                    ],
                )
                mesh = train.parallel_layout(cfg, torch.device("cpu"))
                got = full_state(pith_models.from_pretrained(hf_dir, "cpu", mesh), mesh)
                if rank == 0:
                    assert got.keys() <= whole.keys(), (name, shape)
                    bad = [k for k, t in got.items() if not torch.equal(t, whole[k])]
                    assert not bad, f"{name} {shape}: the sharded load differs for {bad}"

    # Resuming across layouts: cfg6 checkpointed under dp2 x ep2 after RESUME_AT steps.
    ckpt, expected = tmp / "ckpt_ep2_dp2", torch.load(tmp / "ref_cfg6.pt")[0][RESUME_AT:]
    if world == 4:
        run(cfg6, Layout(dp=2, ep=2), steps=range(RESUME_AT), save=ckpt)
        if rank == 0:
            resumed = run(cfg6, None, steps=range(RESUME_AT, STEPS), load=ckpt)[0]
            assert_same_losses(resumed, expected, "ep2xdp2 -> 1 process")
    else:
        resumed = run(cfg6, Layout(dp=2), steps=range(RESUME_AT, STEPS), load=ckpt)[0]
        assert_same_losses(resumed, expected, "ep2xdp2 -> dp2")
    dist.destroy_process_group()


@pytest.mark.distributed
def test_every_layout_trains_like_one_process_and_resumes_in_another_layout(run_ranks, tmp_path):
    for world in (4, 2):  # 4 first: it writes the checkpoint that the 2-rank layouts resume
        run_ranks(__file__, world, tmp_path, timeout=900)  # under torchrun's environment variables


if __name__ == "__main__":
    _worker(Path(sys.argv[3]))
