"""Every parallel layout trains like one process: for tiny Qwen3-MoE, DeepSeek-V2 (MLA) and GPT-OSS
(sliding window, sinks) configs with 8 experts, in fp32, the layouts dp2, ep2, cp2 (2 gloo
processes) and dp2 x ep2, cp2 x ep2, ep4 (4 processes) reproduce the single-process per-step losses
over 5 AdamW steps (with gradient clipping active) to a relative error <= 1e-5, and every
parameter's gradient after the first step.

The step is the engine's part of training only: the five-stage executor, FSDP2, EP all-to-alls, ring
attention on a zigzag split, cross-entropy summed and divided by the global label-token count (so
gradients are summed over ranks), the global gradient norm, AdamW. Each world size is spawned once
(this file run as a script, one process per rank); rank 0 also runs the single-process reference.
"""

import dataclasses
import json
import sys
from datetime import timedelta
from pathlib import Path

import pith_ops
import pytest
import torch
import torch.distributed as dist
from pith_engine import checkpoint, executor
from pith_engine.parallel import (
    Layout,
    Mesh,
    all_reduce_sum,
    build_mesh,
    clip_grad_norm_,
    expert_comm,
    full_state,
    parallelize,
)
from pith_engine.ring_attention import zigzag_positions, zigzag_split
from pith_models import deepseek_v2, gpt_oss, qwen3_moe

MODELS = {
    "qwen3_moe": (qwen3_moe, dataclasses.replace(qwen3_moe.TINY, num_experts=8, mlp_only_layers=())),
    "deepseek_v2": (deepseek_v2, dataclasses.replace(deepseek_v2.TINY, num_hidden_layers=2)),
    # one sliding-window layer (window 5: across the cp2 zigzag chunks of 4) and one full, both with sinks
    "gpt_oss": (gpt_oss, dataclasses.replace(gpt_oss.TINY, num_hidden_layers=2, layer_types=())),
}
LAYOUTS = {
    2: [Layout(dp=2), Layout(ep=2), Layout(cp=2)],
    4: [Layout(dp=2, ep=2), Layout(cp=2, ep=2), Layout(ep=4)],
}
STEPS, GLOBAL_BATCH, MICRO_BATCHES, SEQ = 5, 8, 2, 16
RESUME_AT = 3  # the checkpointed run stops after 3 steps; the resumed ones run steps 3 and 4
MAX_NORM = 0.05  # below the first steps' gradient norms, so clipping acts
LOSS_RTOL = 1e-5
# Adam divides by sqrt(v) + eps: with the default 1e-8, entries whose gradient is ~1e-8 turn fp32
# summation-order noise (~1e-9) into visible weight differences, and a near-tied top-k choice then
# flips; a larger eps keeps both layouts on the same trajectory without hiding a wrong gradient.
ADAM_EPS = 1e-3
GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-7  # gradients are O(1e-2); fp32 summation-order noise is ~1e-9


def batches(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels [STEPS, GLOBAL_BATCH, SEQ]; about 1 label in 8 is ignored (-100)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (STEPS, GLOBAL_BATCH, SEQ), generator=g)
    labels = torch.randint(0, vocab, (STEPS, GLOBAL_BATCH, SEQ), generator=g)
    labels[torch.rand(labels.shape, generator=g) < 0.125] = -100
    return ids, labels


def train(module, cfg, mesh: Mesh, steps=range(STEPS), load=None, save=None) -> tuple[list[float], dict]:
    """-> (global loss of each step, every parameter's full gradient after step 0 if it ran); resumes
    from checkpoint `load` and checkpoints to `save` at the end when given."""
    model = module.Model(cfg)
    module.init_weights(model, seed=0)  # the same weights on every rank, then each keeps its share
    parallelize(model, mesh)
    comm = expert_comm(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=ADAM_EPS, foreach=False)
    if load:
        checkpoint.load(load, model, opt, mesh)
    ids, labels = batches(cfg.vocab_size)
    lay = mesh.layout
    per_rank = GLOBAL_BATCH // MICRO_BATCHES // lay.data_ranks
    losses, grads = [], {}
    for step in steps:
        label_tokens = int((labels[step] != -100).sum())
        ce_sum = torch.zeros(())
        for j in range(MICRO_BATCHES):
            first = (j * lay.data_ranks + mesh.data_rank) * per_rank
            x, y = ids[step, first : first + per_rank], labels[step, first : first + per_rank]
            pos = zigzag_positions(SEQ, lay.cp, mesh.cp_rank).expand(per_rank, -1)
            x, y = zigzag_split(x, lay.cp, mesh.cp_rank), zigzag_split(y, lay.cp, mesh.cp_rank)
            h_BSD, _ = executor.forward(model, x, comm, pos, mesh.cp_group)
            h = h_BSD.flatten(0, 1)
            ce = pith_ops.linear_cross_entropy(h, model.lm_head.weight, y.flatten(), -100, "sum")
            (ce / label_tokens).backward()
            ce_sum += ce.detach()
        losses.append(all_reduce_sum(ce_sum, mesh).item() / label_tokens)
        if step == 0:
            grads = full_state(model, mesh, grads=True)
        clip_grad_norm_(list(model.parameters()), MAX_NORM, mesh)
        opt.step()
        opt.zero_grad(set_to_none=True)
    if save:
        checkpoint.save(save, model, opt, mesh=mesh)
    return losses, grads


def assert_same_losses(losses: list[float], expected: list[float], where: str) -> None:
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, expected, strict=True)]
    assert max(rel) <= LOSS_RTOL, f"{where}: losses {losses}, single process {expected}"


def _worker(world: int, rank: int, tmp: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/store{world}",
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=5),
    )
    cpu = torch.device("cpu")
    single = Mesh(Layout(), cpu)
    for model_name, (module, cfg) in MODELS.items():
        ref = train(module, cfg, single) if rank == 0 else None
        for layout in LAYOUTS[world]:
            losses, grads = train(module, cfg, build_mesh(layout, cpu))
            if rank != 0:
                continue
            where = f"{model_name} {layout}"
            assert_same_losses(losses, ref[0], where)
            assert grads.keys() == ref[1].keys(), where
            rtol, atol = GRAD_RTOL, GRAD_ATOL
            bad = [n for n, g in grads.items() if not torch.allclose(g, ref[1][n], rtol=rtol, atol=atol)]
            assert not bad, f"{where}: gradients differ from the single process for {bad}"

    # Resuming across layouts; 6 experts over ep2 x dp2 are 3 per EP rank in FSDP pieces of 2 and 1.
    cfg6 = dataclasses.replace(MODELS["qwen3_moe"][1], num_experts=6)
    ckpt, expected = tmp / "ckpt_ep2_dp2", tmp / "uninterrupted.json"
    if world == 4:
        if rank == 0:
            expected.write_text(json.dumps(train(qwen3_moe, cfg6, single)[0]))
        train(qwen3_moe, cfg6, build_mesh(Layout(dp=2, ep=2), cpu), steps=range(RESUME_AT), save=ckpt)
        if rank == 0:
            resumed = train(qwen3_moe, cfg6, single, steps=range(RESUME_AT, STEPS), load=ckpt)[0]
            assert_same_losses(resumed, json.loads(expected.read_text())[RESUME_AT:], "ep2xdp2 -> 1 process")
    else:
        mesh = build_mesh(Layout(dp=2), cpu)
        resumed = train(qwen3_moe, cfg6, mesh, steps=range(RESUME_AT, STEPS), load=ckpt)[0]
        assert_same_losses(resumed, json.loads(expected.read_text())[RESUME_AT:], "ep2xdp2 -> dp2")
    dist.destroy_process_group()


@pytest.mark.distributed
def test_every_layout_reproduces_one_process_and_checkpoints_resume_in_another_layout(run_ranks, tmp_path):
    run_ranks(__file__, 4, tmp_path)  # dp2xep2, cp2xep2, ep4; saves under ep2xdp2, resumes on 1 process
    run_ranks(__file__, 2, tmp_path)  # dp2, ep2, cp2; resumes the ep2xdp2 checkpoint under dp2


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
