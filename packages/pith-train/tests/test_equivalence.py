"""Every parallel layout trains like one process, through the trainer itself: for tiny Qwen3-MoE,
DeepSeek-V2 (MLA) and GPT-OSS (sliding window, sinks) configs with 8 experts, in fp32 on CPU, the
layouts dp2, ep2, cp2 (2 gloo processes under torchrun) and dp2 x ep2, cp2 x ep2, ep4 (4 processes;
every model under dp2, cp2 and dp2 x ep2, a cover of them under the others: LAYOUTS) reproduce the
single-process per-step losses (cross-entropy and aux) of 4 steps of the trainer's
`train_step` (2 micro-batches, gradient clipping active, load-balancing loss, z-loss and the expert-bias
update on) to a relative 1e-5, and every parameter's (clipped) gradient of the first step.

Each model is the trainer's sharded build (pith_models.build with the layout's mesh: this rank's
experts and FSDP shards only, drawn from the seed); the layout is the trainer's own
(train.parallel_layout from a Config's [parallel]). A checkpoint written under dp2 x ep2 after 2 steps
resumes on one process and under dp2 to the uninterrupted losses. A bf16 Hugging Face directory of
each family loaded sharded under dp2, ep2, pp2, dp2 x ep2 and pp2 x ep2 (in the default chunks and in
chunks of 300 elements) holds exactly the single-process load's tensors, and each rank reads (through
safetensors slices) exactly its shard's bytes: its pipeline rank's layers, its experts (per-expert
tensors for Qwen3-MoE and DeepSeek-V2, slices of stacked ones for GPT-OSS), its FSDP rows of every
other tensor. train.fp8 under dp2 (FSDP) with ac=selective, ep2 with ac=full and cp2 trains like one
process in FP8 to the tolerances that FP8's per-layout rounding allows (check_fp8_layouts).
"""

import collections
import contextlib
import dataclasses
import itertools
import os
import sys
from pathlib import Path

import pith_models
import pytest
import torch
import torch.distributed as dist
from pith_engine import checkpoint
from pith_engine.fp8 import FP8Switch, GatheredFP8
from pith_engine.parallel import SINGLE, Layout, build_mesh, local_rows
from pith_engine.step import Stages, step_values, train_step
from pith_models import deepseek_v2, gpt_oss, hf, qwen3_moe
from pith_train import train
from pith_train.config import load_config
from pith_train.optim import build_optimizer

sys.path.append(str(Path(__file__).parents[2] / "pith-engine" / "tests"))
from oracles import full_state  # noqa: E402  (the engine tests' oracle)

MODELS = {
    "qwen3_moe": dataclasses.replace(qwen3_moe.TINY, num_experts=8, mlp_only_layers=()),
    "deepseek_v2": dataclasses.replace(deepseek_v2.TINY, num_hidden_layers=2),
    # one sliding-window layer (window 5: across the cp2 zigzag chunks of 4) and one full, both with sinks
    "gpt_oss": dataclasses.replace(gpt_oss.TINY, num_hidden_layers=2, layer_types=()),
}
# World size -> (layout, the models run under it): every model under dp2 and dp2 x ep2 (FSDP, EP and
# both), the attention variants (MLA, sliding window with sinks) under CP, the rest a cover.
ALL = tuple(MODELS)
LAYOUTS = {
    2: [(Layout(dp=2), ALL), (Layout(ep=2), ("qwen3_moe", "deepseek_v2")), (Layout(cp=2), ALL)],
    4: [
        (Layout(dp=2, ep=2), ALL),
        (Layout(cp=2, ep=2), ("qwen3_moe", "gpt_oss")),
        (Layout(ep=4), ("qwen3_moe",)),
    ],
}
# Hugging Face loading: 4 layers (pp2's 4 chunks), a dense first layer whose fused gate_up [2*97, D]
# FSDP cuts over 4 ranks in pieces of 49 (one straddles the gate/up boundary), tied embeddings.
# Ranks holding no experts: qwen3's 2 experts over ep2 x dp2 leave one FSDP piece empty; deepseek's
# first 3 layers are dense, so pp2's rank 1 (layers 1 and 2 of the V) holds none.
HF_MODELS = {
    "qwen3_moe": dataclasses.replace(
        qwen3_moe.TINY, num_hidden_layers=4, intermediate_size=97, tie_word_embeddings=True, num_experts=2
    ),
    "deepseek_v2": dataclasses.replace(
        deepseek_v2.TINY, num_hidden_layers=4, intermediate_size=97, first_k_dense_replace=3
    ),
    "gpt_oss": dataclasses.replace(gpt_oss.TINY, num_hidden_layers=4, layer_types=()),
}
HF_LAYOUTS = {2: [Layout(dp=2), Layout(ep=2), Layout(pp=2)], 4: [Layout(dp=2, ep=2), Layout(pp=2, ep=2)]}
STEPS, GLOBAL_BATCH, MICRO_BATCHES, SEQ, LR = 4, 8, 2, 16, 1e-2
RESUME_AT = 2  # the checkpointed run stops after 2 steps; the resumed ones run steps 2 and 3
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


def run(model_cfg, shape: Layout | None, steps=range(STEPS), load=None, save=None, train_overrides=()):
    """-> (per-step (loss, aux), every parameter's full gradient at step 0 if it ran); shape None: one
    process without groups. Resumes from checkpoint `load`, checkpoints to `save` at the end.
    train_overrides (train.fp8, train.ac): the model and stages as the trainer sets them up."""
    shape = shape or Layout()
    per_rank = GLOBAL_BATCH // MICRO_BATCHES // shape.data_ranks
    parallel = [f"parallel.{k}={v}" for k, v in dataclasses.asdict(shape).items()]
    cfg = load_config(None, [*OVERRIDES, f"train.micro_batch={per_rank}", *parallel, *train_overrides])
    cpu = torch.device("cpu")
    mesh = SINGLE if shape.world == 1 else train.parallel_layout(cfg, cpu)
    model = pith_models.build(model_cfg, cpu, cfg.train.seed, mesh)
    train.apply_fp8(cfg, model, False)
    optimizer = build_optimizer(model, cfg)
    stages = train.trainer_stages(cfg, model, mesh) if train_overrides else Stages(model, mesh)
    settings = train.step_settings(cfg, model)
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


@contextlib.contextmanager
def counting_reads():
    """-> a Counter of the bytes pith_models.hf reads of each HF tensor (through safetensors slices,
    its only way of reading data) inside the block."""
    read, safe_open = collections.Counter(), hf.safe_open

    class Counting:
        def __init__(self, *args, **kwargs):
            self.file = safe_open(*args, **kwargs)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def __getattr__(self, name):  # keys
            return getattr(self.file, name)

        def get_slice(self, k):
            return Slice(self.file.get_slice(k), k)

    class Slice:
        def __init__(self, piece, k):
            self.piece, self.k, self.get_shape = piece, k, piece.get_shape

        def __getitem__(self, index):
            t = self.piece[index]
            read[self.k] += t.nbytes
            return t

    hf.safe_open = Counting
    try:
        yield read
    finally:
        hf.safe_open = safe_open


def check_sharded_hf_loads(tmp: Path, world: int) -> None:
    """Every rank's sharded load of a bf16 Hugging Face directory, in the default chunks and in chunks
    of 300 elements (many passes per layer), holds exactly the single-process load's tensors, and
    reads exactly its shard's bytes: of its pipeline rank's layers only (no embedding or lm_head off
    pp rank 0), its experts, and of each dense tensor its FSDP rows."""
    rank = dist.get_rank()
    for name, model_cfg in HF_MODELS.items():
        hf_dir = tmp / f"hf_{name}_{world}"
        if rank == 0:
            pith_models.save_pretrained(pith_models.build(model_cfg, "cpu", 1), hf_dir)
        dist.barrier()
        whole = pith_models.from_pretrained(hf_dir).state_dict()
        for shape, chunk in itertools.product(HF_LAYOUTS[world], (None, 300)):
            mesh = build_mesh(shape, torch.device("cpu"))
            with counting_reads() as read:
                model = pith_models.from_pretrained(hf_dir, "cpu", mesh, chunk=chunk)
            where = f"{name} {shape} chunk {chunk} rank {rank}"
            got = full_state(model, mesh)
            assert got and got.keys() <= whole.keys(), where
            bad = [k for k, t in got.items() if not torch.equal(t, whole[k])]
            assert not bad, f"{where}: the sharded load differs for {bad}"
            shard = sum(local_rows(p)[0].numel() * torch.bfloat16.itemsize for p in model.parameters())
            assert sum(read.values()) == shard, f"{where}: read {sum(read.values())} bytes, holds {shard}"
            if mesh.pp_rank != 0:
                assert not [k for k, n in read.items() if n and ("embed_tokens" in k or "lm_head" in k)], (
                    where
                )


FP8_STEPS = 3
# Each FP8 layout with one recompute mode: FSDP with the expert MLPs recomputed, EP with every stage.
FP8_RUNS = [(Layout(dp=2), "selective"), (Layout(ep=2), "full"), (Layout(cp=2), "none")]
FP8_GRAD_RTOL = 0.12  # relative Frobenius norm, an FP8 GEMM's weight gradient (check_fp8_layouts)


def fp8_gemm_weights(model_cfg) -> set[str]:
    """The parameters whose gradients an FP8 weight GEMM computes (use_fp8's modules)."""
    model = pith_models.build(model_cfg)
    return {
        f"{m_name}.{p_name}".lstrip(".")
        for m_name, m in model.named_modules()
        if isinstance(m, FP8Switch)
        for p_name, p in m.named_parameters(recurse=False)
        if p.ndim > 1
    }


def check_fp8_layouts(rank: int, ref_fp32: list) -> None:
    """train.fp8 under FSDP, EP and CP with activation checkpointing against one process in FP8.

    What must agree and to what: an FP8 GEMM quantises each operand along its contracted axis. The
    forward and dgrad contract over features, so every token's rows are quantised alike in any layout:
    the step-0 losses and every gradient that only activations' gradients feed (norms, router,
    embedding, lm_head, biases) agree to fp32 summation order (RTOL, GRAD_RTOL). The wgrad contracts
    over tokens: its column scales are taken over a rank's tokens, so under a split of the tokens
    its operands round differently. Both layouts' weight gradients are within 0.06 of the
    unquantised product (pith-ops' bound for the FP8 GEMMs), so within 0.12 of each other
    (FP8_GRAD_RTOL; measured: 0.0024, most columns' power-of-two scales being the same over half the
    tokens; a lost or doubled shard of the gradient would be 0.5 or more). From step 1 on the weights
    differ by that much of one update: each later loss must be as close to the one-process FP8 run
    as that run is to the fp32 one (the layout perturbs
    the gradients by less than FP8 itself does: a different rounding of some columns only; measured:
    at most 2.8e-4 relative against FP8's 3.3e-4 and 5.3e-4 at steps 1 and 2)."""
    model_cfg = MODELS["qwen3_moe"]
    fp8 = ["train.fp8=true"]
    ref_losses, ref_grads = run(model_cfg, None, steps=range(FP8_STEPS), train_overrides=fp8)
    gemm_weights = fp8_gemm_weights(model_cfg)
    for shape, ac in FP8_RUNS:
        losses, grads = run(
            model_cfg, shape, steps=range(FP8_STEPS), train_overrides=[*fp8, f"train.ac={ac}"]
        )
        if shape.ep == 1:  # FSDP over dp2 or cp2: every FP8 weight sharded
            check_fp8_all_gather(model_cfg, shape, [*fp8, f"train.ac={ac}"], losses, grads)
        if rank != 0:
            continue
        where = f"fp8 {shape} ac={ac}"
        assert_same_losses(losses[:1], ref_losses[:1], where)
        for (loss, _), (want, _), (fp32, _) in zip(losses[1:], ref_losses[1:], ref_fp32[1:], strict=True):
            assert abs(loss - want) <= abs(want - fp32) + RTOL * abs(want), (
                where,
                losses,
                ref_losses,
                ref_fp32,
            )
        assert grads.keys() == ref_grads.keys() and gemm_weights < grads.keys(), where
        for n, g in grads.items():
            want = ref_grads[n]
            if n in gemm_weights:
                assert (g - want).norm() <= FP8_GRAD_RTOL * want.norm(), (where, n)
            else:
                assert torch.allclose(g, want, GRAD_RTOL, GRAD_ATOL), (where, n, (g - want).abs().max())


def check_fp8_all_gather(model_cfg, shape: Layout, overrides: list[str], losses, grads) -> None:
    """train.fp8_all_gather: FSDP gathers the FP8 weights in e4m3, each rank quantising its shard with
    the whole weight's scale. On CPU the gathered weight is fp32, so the e4m3 copies, and with them
    the losses and every gradient, are bit for bit those of the same run gathering fp32 (`losses`,
    `grads`), the activation recompute's second gathers included. Counted: every FP8 weight (4
    projections and 2 expert weights per layer, 2 layers) reaches its module as a GatheredFP8 at
    least once."""
    gathered = collections.Counter()

    def count(module, args, out):  # a global hook runs before FSDP's reshard: the gathered weights
        own = module.parameters(recurse=False)
        gathered.update(tuple(p.shape) for p in own if isinstance(p, GatheredFP8))

    hook = torch.nn.modules.module.register_module_forward_hook(count)
    try:
        got = run(
            model_cfg,
            shape,
            steps=range(FP8_STEPS),
            train_overrides=[*overrides, "train.fp8_all_gather=true"],
        )
    finally:
        hook.remove()
    assert got[0] == losses and got[1].keys() == grads.keys(), (got[0], losses)
    assert all(torch.equal(got[1][n], g) for n, g in grads.items())
    D, H, G, Dh, E, F = (getattr(model_cfg, k) for k in ("hidden_size", "num_attention_heads",
        "num_key_value_heads", "head_dim", "num_experts", "moe_intermediate_size"))  # fmt: skip
    shapes = {(H * Dh, D), (G * Dh, D), (D, H * Dh), (E, D, 2 * F), (E, F, D)}
    assert shapes <= gathered.keys(), gathered


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
    for shape, names in LAYOUTS[world]:
        for name in names:
            ref = torch.load(tmp / f"ref_{name}.pt") if rank == 0 else None
            losses, grads = run(MODELS[name], shape)
            if rank != 0:
                continue
            where = f"{name} {shape}"
            assert_same_losses(losses, ref[0], where)
            assert grads.keys() == ref[1].keys(), where
            bad = [n for n, g in grads.items() if not torch.allclose(g, ref[1][n], GRAD_RTOL, GRAD_ATOL)]
            assert not bad, f"{where}: gradients differ from the single process for {bad}"

    check_sharded_hf_loads(tmp, world)
    if world == 2:
        ref_fp32 = torch.load(tmp / "ref_qwen3_moe.pt")[0][:FP8_STEPS] if rank == 0 else None
        check_fp8_layouts(rank, ref_fp32=ref_fp32)

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
