"""Every parallel layout trains like one process: for tiny Qwen3-MoE and DeepSeek-V2 (MLA) configs
with 8 experts, in fp32, the layouts dp2, ep2, cp2 (2 gloo processes) and dp2 x ep2, cp2 x ep2, ep4
(4 processes) reproduce the single-process per-step losses over 5 AdamW steps (with gradient
clipping active) to a relative error <= 1e-5, and every parameter's gradient after the first step.

The step is the engine's part of training only: the five-stage executor, FSDP2, EP all-to-alls, ring
attention on a zigzag split, cross-entropy summed and divided by the global label-token count (so
gradients are summed over ranks), the global gradient norm, AdamW. Each world size is spawned once
(this file run as a script, one process per rank); rank 0 also runs the single-process reference.
"""

import dataclasses
import sys
from datetime import timedelta
from pathlib import Path

import pith_ops
import pytest
import torch
import torch.distributed as dist
from pith_engine import executor
from pith_engine.parallel import (
    Layout,
    Mesh,
    build_mesh,
    clip_grad_norm_,
    expert_comm,
    full_state,
    parallelize,
)
from pith_engine.ring_attention import zigzag_positions, zigzag_split
from pith_models import deepseek_v2, qwen3_moe

MODELS = {
    "qwen3_moe": (qwen3_moe, dataclasses.replace(qwen3_moe.TINY, num_experts=8, mlp_only_layers=())),
    "deepseek_v2": (deepseek_v2, dataclasses.replace(deepseek_v2.TINY, num_hidden_layers=2)),
}
LAYOUTS = {
    2: [Layout(dp=2), Layout(ep=2), Layout(cp=2)],
    4: [Layout(dp=2, ep=2), Layout(cp=2, ep=2), Layout(ep=4)],
}
STEPS, GLOBAL_BATCH, MICRO_BATCHES, SEQ = 5, 8, 2, 16
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


def train(module, cfg, mesh: Mesh) -> tuple[list[float], dict[str, torch.Tensor]]:
    """-> (global loss of each step, every parameter's full gradient after the first step)."""
    model = module.Model(cfg)
    module.init_weights(model, seed=0)  # the same weights on every rank, then each keeps its share
    parallelize(model, mesh)
    comm = expert_comm(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=ADAM_EPS, foreach=False)
    ids, labels = batches(cfg.vocab_size)
    lay = mesh.layout
    per_rank = GLOBAL_BATCH // MICRO_BATCHES // lay.data_ranks
    losses, grads = [], {}
    for step in range(STEPS):
        label_tokens = int((labels[step] != -100).sum())
        ce_sum = torch.zeros(())
        for j in range(MICRO_BATCHES):
            rows = slice(j * per_rank * lay.data_ranks + mesh.data_rank * per_rank, None)
            rows = slice(rows.start, rows.start + per_rank)
            x, y = ids[step, rows], labels[step, rows]
            pos = zigzag_positions(SEQ, lay.cp, mesh.cp_rank).expand(per_rank, -1)
            x, y = zigzag_split(x, lay.cp, mesh.cp_rank), zigzag_split(y, lay.cp, mesh.cp_rank)
            h_BSD, _ = executor.forward(model, x, comm, pos, mesh.cp_group)
            h = h_BSD.flatten(0, 1)
            ce = pith_ops.linear_cross_entropy(h, model.lm_head.weight, y.flatten(), -100, "sum")
            (ce / label_tokens).backward()
            ce_sum += ce.detach()
        if mesh.reduce_group is not None:
            dist.all_reduce(ce_sum, group=mesh.reduce_group)
        losses.append(ce_sum.item() / label_tokens)
        if step == 0:
            grads = full_state(model, mesh, grads=True)
        clip_grad_norm_(list(model.parameters()), MAX_NORM, mesh)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


def _worker(world: int, rank: int, tmp: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    cpu = torch.device("cpu")
    for model_name, (module, cfg) in MODELS.items():
        ref = train(module, cfg, Mesh(Layout(), cpu)) if rank == 0 else None
        for layout in LAYOUTS[world]:
            losses, grads = train(module, cfg, build_mesh(layout, cpu))
            if rank != 0:
                continue
            where = f"{model_name} {layout}"
            ref_losses, ref_grads = ref
            rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)]
            assert max(rel) <= LOSS_RTOL, f"{where}: losses {losses} vs single process {ref_losses}"
            assert grads.keys() == ref_grads.keys(), where
            rtol, atol = GRAD_RTOL, GRAD_ATOL
            bad = [n for n, g in grads.items() if not torch.allclose(g, ref_grads[n], rtol=rtol, atol=atol)]
            assert not bad, f"{where}: gradients differ from the single process for {bad}"
    dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_every_layout_reproduces_single_process_losses_and_gradients(run_ranks, tmp_path, world):
    run_ranks(__file__, world, tmp_path)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
