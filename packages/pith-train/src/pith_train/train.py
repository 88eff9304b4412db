"""`pretrain`: build the model and data from a Config, then the training loop.

The loss of an optimizer step is sum(cross-entropy over every label token of the global batch) /
(label tokens in the global batch), plus the MoE auxiliary losses averaged over its micro-batches.
Each data rank back-propagates its share of that number (its tokens' cross-entropy over the global
count, its share of the aux terms), so the shares add up to the single-process loss: gradients must be
SUMMED over data ranks (not averaged) for any layout to reproduce single-process training.

Shape legend: B sequences, S sequence length, T = B*S tokens, D hidden, E experts, K top-k.
"""

import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pith_models
import pith_ops
import torch
import torch.distributed as dist
from pith_engine import checkpoint, executor, parallel
from pith_engine.contract import Routing
from pith_engine.executor import ExpertComm, LocalExperts
from pith_engine.layers import use_fp8
from pith_engine.ring_attention import zigzag_positions, zigzag_split
from pith_models import deepseek_v2
from pith_ops.fp8_grouped_gemm import GROUP_ALIGN
from torch import Tensor, nn
from torch.autograd.profiler import record_function
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from tqdm import tqdm

from pith_train import config as config_mod
from pith_train import rundir
from pith_train.config import Config, ModelConfig, model_config
from pith_train.data import PackedDataset, WindowLoader
from pith_train.metrics import MetricsLog, log_line, peak_flops, peak_memory_gib
from pith_train.optim import AdamW, build_optimizer, lr_at
from pith_train.prepare import load_tokenizer, prepare, stdlib_corpus
from pith_train.stopping import Interrupted, StopOnSignal

IGNORE_INDEX = -100


@dataclass
class Layout:
    """Where this process sits in the parallel layout: the single-process values by default."""

    rank: int = 0  # global rank; rank 0 prints, writes metrics and checkpoint metadata
    world: int = 1
    data_rank: int = 0  # which contiguous slice of each micro-batch this process holds
    data_ranks: int = 1  # ranks taking different sequences (dp * ep)
    data_group: ProcessGroup | None = None  # sums loss terms, token and expert counts: dp x cp x ep ranks
    comm: ExpertComm = field(default_factory=LocalExperts)  # stages 2 and 4
    mesh: parallel.Mesh = field(default_factory=lambda: parallel.Mesh(parallel.Layout(), torch.device("cpu")))


def parallel_layout(cfg: Config, device: torch.device) -> Layout:
    """This process's place in cfg.parallel (the world from torchrun's env), checked before any compute."""
    shape = parallel.Layout(**dataclasses.asdict(cfg.parallel))
    parallel.check_layout(
        shape,
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        num_experts=parallel.num_experts(pith_models.build(model_config(cfg.model))),  # on meta
        seq_len=cfg.data.seq_len,
        global_batch=cfg.train.global_batch,
        micro_batch=cfg.train.micro_batch,
    )
    mesh = parallel.build_mesh(shape, device)
    rank = dist.get_rank() if dist.is_initialized() else 0
    comm = parallel.expert_comm(mesh, GROUP_ALIGN if cfg.train.fp8 else 1)  # FP8: 16-row expert groups
    return Layout(rank, shape.world, mesh.data_rank, shape.data_ranks, mesh.reduce_group, comm, mesh)


def local_tokens(inputs_BS: Tensor, labels_BS: Tensor, mesh: parallel.Mesh):
    """-> (inputs, labels, position ids or None): under context parallelism this rank's zigzag share of
    its sequences (chunks r and 2cp-1-r) and their global positions; otherwise all of them."""
    cp, r = mesh.layout.cp, mesh.cp_rank
    if cp == 1:
        return inputs_BS, labels_BS, None
    pos_BS = zigzag_positions(inputs_BS.shape[1], cp, r).expand(inputs_BS.shape[0], -1)
    return zigzag_split(inputs_BS, cp, r), zigzag_split(labels_BS, cp, r), pos_BS


def _forward(stages, inputs_BS: Tensor, pos_BS: Tensor | None, layout: Layout, device: torch.device):
    pos_BS = None if pos_BS is None else pos_BS.to(device)
    return executor.forward(stages, inputs_BS.to(device), layout.comm, pos_BS, layout.mesh.cp_group)


def _all_sum(t: Tensor, group: ProcessGroup | None) -> Tensor:
    if group is not None:
        dist.all_reduce(t, group=group)
    return t


class Stages:
    """The model as the trainer runs it: its stage functions, optionally compiled and checkpointed, with
    the residual stream in `dtype`. The executor only calls prologue / positions / layers' stages /
    epilogue, which this provides.

    compile: torch.compile of the non-expert stage functions. Expert GEMMs (stage 3) stay eager: they
    run the grouped-GEMM kernel on data-dependent group sizes. On one process fullgraph=True. Under
    FSDP a stage method is FSDP's wrapper (its unshard / reshard and backward hooks around the model's
    body, pith_engine.parallel), and dynamo runs FSDP's hooks eagerly (torch._dynamo.disable'd), so
    the compiled function breaks the graph exactly there and the body in between is one graph, as
    TorchTitan's per-block compile keeps the hooks outside; fullgraph is off for that reason only (the
    router's FSDP unit, an fp32 island, adds one more pair of breaks inside stage 1; test_compile.py
    checks that FSDP's hooks are the only breaks).
    ac, activation checkpointing (recompute in the backward what is not kept from the forward):
    "none"; "selective": the expert MLPs (stage 3), whose hidden rows (T*K of 3F) are the largest
    activations and whose weights' bf16 casts would otherwise be kept; "full": stages 1, 3 and 5 of
    every layer, keeping only each stage's inputs.
    dtype: the residual stream's dtype after the embedding (bf16 under autocast on CUDA, so that the
    routed rows, the expert GEMMs and the fused loss run in bf16 too); None keeps the embedding's.
    """

    class Layer:
        def __init__(self, layer: nn.Module, compiled, ac: str):
            # Checkpoint inside compile: torch.compile traces it and its partitioner does the recompute.
            recompute = lambda fn: lambda *args: torch_checkpoint(fn, *args, use_reentrant=False)
            full = recompute if ac == "full" else lambda fn: fn
            self.stage1 = compiled(full(layer.stage1))
            self.stage3 = recompute(layer.stage3) if ac != "none" else layer.stage3
            self.stage5 = compiled(full(layer.stage5))

    def __init__(self, model: nn.Module, compile: bool = False, ac: str = "none", dtype=None):
        fullgraph = not isinstance(model, FSDPModule)
        compiled = functools.partial(torch.compile, fullgraph=fullgraph) if compile else lambda fn: fn
        self.layers = {i: self.Layer(layer, compiled, ac) for i, layer in model.layers.items()}
        self.lm_head = model.lm_head
        self.positions = model.positions
        self.prologue = compiled(lambda ids: model.prologue(ids).to(dtype))
        self.epilogue = compiled(model.epilogue)


def loss_sum(h_BSD: Tensor, lm_head: nn.Linear, labels_T: Tensor) -> Tensor:
    """Cross-entropy summed over the label tokens, lm_head fused, in h's dtype (the weight cast to it)."""
    w_VD = pith_ops.cast(lm_head.weight, h_BSD.dtype)
    return pith_ops.linear_cross_entropy(h_BSD.flatten(0, 1), w_VD, labels_T, IGNORE_INDEX, "sum")


def moe_aux(routings: list[Routing], cfg: Config, tokens: int, group: ProcessGroup | None):
    """This rank's share of (load-balancing loss + z-loss) of one micro-batch, and expert counts [L, E].

    Global-batch load balancing, per MoE layer: E * sum_e f_e * P_e with f_e the fraction of the
    micro-batch's routed (token, k) entries that chose expert e, counted over every data rank, and P_e
    the router probability of e averaged over the micro-batch's `tokens` (all ranks). Each rank sums
    only its own tokens' probabilities, so the ranks' shares add up to the whole. The z-loss is the
    mean over tokens of logsumexp(router logits)^2. Both are averaged over the MoE layers.
    """
    # Counted by scatter-add: torch.bincount sizes its output from the data (2 host syncs per call).
    ids_LN = torch.stack([r.expert_ids_TK.flatten() for r in routings])
    counts_LE = torch.zeros(len(routings), routings[0].probs_TE.shape[1], device=ids_LN.device)
    counts_LE.scatter_add_(1, ids_LN, torch.ones_like(ids_LN, dtype=counts_LE.dtype))
    _all_sum(counts_LE, group)
    lbl = z = torch.zeros((), device=counts_LE.device)
    for r, counts_E in zip(routings, counts_LE):
        E, K = r.probs_TE.shape[1], r.expert_ids_TK.shape[1]
        if cfg.train.lbl_coef:
            lbl = lbl + E * (counts_E / (tokens * K) * r.probs_TE.sum(0) / tokens).sum()
        if cfg.train.z_loss_coef:
            z = z + (torch.logsumexp(r.logits_TE.float(), dim=-1) ** 2).sum() / tokens
    aux = (cfg.train.lbl_coef * lbl + cfg.train.z_loss_coef * z) / max(1, len(routings))
    return aux, counts_LE


def expert_biases(model: nn.Module) -> list[Tensor]:
    """The routers' expert_bias buffers [E], one per MoE layer, in layer order."""
    return [
        b for layer in model.layers.values() for n, b in layer.named_buffers() if n.endswith("expert_bias")
    ]


@torch.no_grad()
def update_expert_bias(biases: list[Tensor], counts_LE: Tensor, rate: Tensor | float) -> None:
    """Aux-loss-free balancing (DeepSeek-V3): bias += rate * sign(mean load - load), per MoE layer.

    The counts are the step's, summed over micro-batches and data ranks, so every rank updates alike;
    a device-scalar rate (0 for a skipped step) needs no host sync.
    """
    for bias_E, counts_E in zip(biases, counts_LE, strict=True):
        bias_E += rate * torch.sign(counts_E.mean() - counts_E)


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: 6 * N_active + 6 * L * S * H * (Dqk + Dv).

    N_active counts the matmul weights one token goes through: every parameter except the embedding
    lookup and vectors (norm scales, biases), with a stacked expert weight counted at K/E of its size
    (K of E experts per token; from the model config). The factor 6 is 2 FLOPs per multiply-add,
    times 3 for the forward plus a backward of twice its cost. The attention term is the score
    (Dqk) and value (Dv) matmuls over the full S x S matrix per layer, ignoring causal masking, the
    PaLM / TorchTitan convention (a causal kernel does about half of it).
    """
    c = model.cfg
    experts = checkpoint.expert_param_names(model)
    lookup_only = model.embed_tokens.weight is not model.lm_head.weight
    active = 0.0
    for name, p in model.named_parameters():
        if p.ndim < 2 or (lookup_only and p is model.embed_tokens.weight):
            continue
        active += p.numel() * (c.num_experts_per_tok / p.shape[0] if name in experts else 1)
    # MLA (DeepSeek-V2) has distinct q/k and v head dims; the other families one head_dim.
    qk, v = (c.qk_head_dim, c.v_head_dim) if isinstance(c, deepseek_v2.Config) else (c.head_dim, c.head_dim)
    return 6 * active + 6 * c.num_hidden_layers * seq_len * c.num_attention_heads * (qk + v)


def train_step(
    model: nn.Module,
    stages,
    optimizer: AdamW,
    micro: list[tuple[Tensor, Tensor]],
    cfg: Config,
    layout: Layout,
    lr: float,
    biases: list[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor | int]:
    """One optimizer step over this rank's micro-batches [(inputs_BS, labels_BS)]: forward and backward
    of each (bf16 autocast on CUDA), then the gradient norm, AdamW at `lr` with the clip coefficient
    folded into its update, the expert-bias update.

    -> (loss, aux loss, gradient norm, expert counts [L, E]) as device tensors: no host sync of its
    own, so the CPU queues the whole step ahead of the GPU (step_values reads them in one sync). A
    non-finite loss or gradient norm skips the update on the device: weights, moments and expert
    biases stay as they were, and step_values raises FloatingPointError.
    """
    device = model.lm_head.weight.device
    micro = [
        tuple(_to_device(t, device) for t in local_tokens(inputs_BS, labels_BS, layout.mesh))
        for inputs_BS, labels_BS in micro
    ]
    label_tokens = _all_sum(sum((labels != IGNORE_INDEX).sum() for _, labels, _ in micro), layout.data_group)
    micro_tokens = cfg.train.micro_batch * cfg.data.seq_len * layout.data_ranks  # one micro-batch, all ranks
    M = cfg.micro_batches
    for group in optimizer.param_groups:
        group["lr"] = lr
    sums = torch.zeros(2, device=device)  # (cross-entropy sum, aux share)
    counts_LE = 0
    for j, (inputs_BS, labels_BS, pos_BS) in enumerate(micro):
        parallel.gradient_sync(model, last=j == len(micro) - 1)  # one reduction per optimizer step
        with torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda"):
            h_BSD, routings = _forward(stages, inputs_BS, pos_BS, layout, device)
            with record_function("lm_head+loss"):
                ce = loss_sum(h_BSD, model.lm_head, labels_BS.flatten())
        aux, counts = (
            moe_aux(routings, cfg, micro_tokens, layout.data_group)
            if routings
            else (torch.zeros((), device=device), 0)
        )
        (ce.float() / label_tokens + aux / M).backward()
        sums += torch.stack([ce.detach().float(), aux.detach() / M])
        counts_LE = counts_LE + counts
    sums = _all_sum(sums, layout.data_group)
    loss, aux_loss = sums[0] / label_tokens, sums[1]
    with record_function("optimizer"):
        grad_norm = parallel.grad_norm(list(model.parameters()), layout.mesh)
        finite = torch.isfinite(loss + aux_loss + grad_norm)
        coef = parallel.clip_coef(grad_norm, cfg.optim.grad_clip)
        optimizer.step(grad_scale=torch.where(finite, coef, torch.nan).reshape(1))
        optimizer.zero_grad(set_to_none=True)
        if biases:
            update_expert_bias(biases, counts_LE, finite * cfg.train.bias_rate)
    return loss, aux_loss, grad_norm, counts_LE


def _to_device(t: Tensor | None, device: torch.device) -> Tensor | None:
    # From pinned memory without blocking: a copy from pageable memory waits for the whole stream.
    if t is None or t.device == device or device.type != "cuda":
        return None if t is None else t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def step_values(loss: Tensor, aux: Tensor, grad_norm: Tensor, counts_LE: Tensor | int):
    """train_step's outputs read in one host sync -> (loss, aux, grad norm, max/mean expert load per
    MoE layer); FloatingPointError when the step was skipped for a non-finite value."""
    parts = [loss.float().reshape(1), aux.float().reshape(1), grad_norm.float().reshape(1)]
    if isinstance(counts_LE, Tensor):
        parts.append(counts_LE.amax(1) / counts_LE.mean(1))
    loss, aux, norm, *load = torch.cat(parts).tolist()
    if not math.isfinite(loss + aux + norm):
        raise FloatingPointError(f"loss is {loss} (aux {aux}, gradient norm {norm})")
    return loss, aux, norm, load


def build_model(
    model: ModelConfig | str,
    device: torch.device,
    seed: int,
    mesh: parallel.Mesh = parallel.SINGLE,
    param_dtype: torch.dtype | None = None,
) -> nn.Module:
    """This rank's part (its experts, its FSDP shards over `mesh`) of a zoo model initialised from
    seed, a Hugging Face directory or a Pith checkpoint's weights; only that part is materialised, and
    only that part is read from a directory."""
    model = ModelConfig(model) if isinstance(model, str) else model
    cfg = model_config(model)
    if model.name in pith_models.MODELS or not (Path(model.name) / ".metadata").is_file():
        if model.name in pith_models.MODELS:
            return pith_models.build(cfg, device, seed, mesh, param_dtype)
        return pith_models.from_pretrained(model.name, device, mesh, param_dtype)
    built = pith_models.build(cfg, device, seed, mesh, param_dtype)
    checkpoint.load(Path(model.name), built, mesh=mesh)  # DCP reads this rank's pieces
    return built


def open_data(cfg: Config, run_dir: Path, layout: Layout) -> PackedDataset:
    """The configured dataset; the built-in corpus is prepared into RUN_DIR/data on first use."""
    tok = load_tokenizer(cfg.data.tokenizer)
    path = Path(cfg.data.path) if cfg.data.path else run_dir / "data"
    if not cfg.data.path and not (path / "meta.json").is_file():
        if layout.rank == 0:
            prepare(stdlib_corpus(), str(path), cfg.data.tokenizer, progress=cfg.log.progress)
        if dist.is_initialized():
            dist.barrier()
    if not path.exists():
        raise ValueError(f"data.path {str(path)!r} does not exist")
    ds = PackedDataset(str(path))
    ds.check_tokenizer(tok)
    return ds


def _device(cfg: Config) -> torch.device:
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device is cuda, but torch sees no CUDA device")
    use_cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))


def pretrain(
    cfg: Config, run_dir: str | Path, layout: Layout | None = None, stop_at: int | None = None
) -> dict:
    """Train per `cfg` in `run_dir`, resuming from its latest intact checkpoint; stop after step
    `stop_at` if given. SIGINT/SIGTERM stop it after the current step with a checkpoint (Interrupted).

    Returns a summary: final step, last loss, validation loss, and the run's paths.
    """
    device = _device(cfg)
    if device.type == "cpu" and cfg.train.cpu_threads:
        torch.set_num_threads(cfg.train.cpu_threads)
    layout = layout or parallel_layout(cfg, device)
    run_dir = Path(run_dir)
    main = layout.rank == 0
    ckpt_root = run_dir / "checkpoints"
    # -- the run directory and the inputs, checked before any training compute
    model_cfg = model_config(cfg.model)
    warn = tqdm.write if main else lambda text: None
    resume_from = rundir.preflight(cfg, run_dir, model_cfg, layout.mesh, warn)
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
    ds = open_data(cfg, run_dir, layout)
    ds.check_vocab(model_cfg.vocab_size)
    loader = WindowLoader(ds, cfg.data.seq_len, cfg.data.val_windows, cfg.train.seed)
    if main:
        rundir.write_config(run_dir, cfg)
    torch.manual_seed(cfg.train.seed)
    cuda = device.type == "cuda"
    # Each rank builds only its experts and its FSDP shards (fp32); bf16 all-gathers, fp32 reduction.
    model = build_model(cfg.model, device, cfg.train.seed, layout.mesh, torch.bfloat16 if cuda else None)
    use_fp8(model, cfg.train.fp8)
    optimizer = build_optimizer(model, cfg)
    biases = expert_biases(model)
    step, cursor = 0, 0
    if resume_from is not None:
        checkpoint.load(resume_from, model, optimizer, layout.mesh, verify=False)  # latest_intact verified it
        state = rundir.read_json(resume_from / "trainer.json")
        step, cursor = state["step"], state["cursor"]
    stages = Stages(model, cfg.train.compile and cuda, cfg.train.ac, torch.bfloat16 if cuda else None)
    autocast = torch.autocast("cuda", torch.bfloat16, enabled=cuda)
    flops = flops_per_token(pith_models.build(model_cfg), cfg.data.seq_len)  # the whole model, on meta
    peak, peak_source = peak_flops(device)
    metrics = MetricsLog(
        run_dir, step, main, cfg.log.tensorboard, cfg.log.wandb, dataclasses.asdict(cfg)
    )  # fmt: skip
    G, S = cfg.train.global_batch, cfg.data.seq_len
    last = min(cfg.train.steps, stop_at or cfg.train.steps)
    terminal = sys.stderr.isatty()
    bar = tqdm(
        total=cfg.train.steps, initial=step, disable=not (main and cfg.log.progress and terminal), unit="step"
    )
    log_every = cfg.log.every or (0 if terminal else 1)
    if main:
        bar.write(f"{cfg.model.name} on {device}, from step {step}; peak {peak:.3g} FLOP/s ({peak_source})")

    def evaluate() -> float:
        total = torch.zeros(2, device=device)
        with torch.no_grad(), autocast:
            for batch in loader.val_batches(cfg.train.micro_batch, layout.data_rank, layout.data_ranks):
                inputs_BS, labels_BS, pos_BS = local_tokens(*batch, layout.mesh)
                h_BSD, _ = _forward(stages, inputs_BS, pos_BS, layout, device)
                labels_T = labels_BS.to(device).flatten()
                ce = loss_sum(h_BSD, model.lm_head, labels_T)
                total += torch.stack([ce.float(), (labels_T != IGNORE_INDEX).sum().float()])
        total = _all_sum(total, layout.data_group)
        return (total[0] / total[1]).item()

    def save(step: int) -> Path:
        files = {
            "trainer.json": json.dumps({"step": step, "cursor": cursor}),
            "config.json": json.dumps(model.cfg.to_hf(), indent=1),
            "config.toml": config_mod.to_toml(cfg),  # what a resume is checked against
        }
        if cfg.data.tokenizer != "byte":  # the run's tokenizer travels with its weights (generate, convert)
            files["tokenizer.json"] = Path(cfg.data.tokenizer).read_text()
        path = checkpoint.save(ckpt_root / f"step_{step:06d}", model, optimizer, files, layout.mesh)
        checkpoint.prune(ckpt_root, cfg.checkpoint.keep)
        return path

    record = {}
    with StopOnSignal() as stop, contextlib.closing(metrics):
        while step < last:
            start = time.perf_counter()
            micro = loader.step_batch(cursor, G, cfg.train.micro_batch, layout.data_rank, layout.data_ranks)
            lr = lr_at(step, cfg)
            try:
                loss, aux_loss, grad_norm, load = step_values(
                    *train_step(model, stages, optimizer, micro, cfg, layout, lr, biases)
                )
            except FloatingPointError as e:
                good = next(
                    (p for p in reversed(checkpoint.checkpoints(ckpt_root)) if not checkpoint.problem(p)),
                    None,
                )
                raise FloatingPointError(
                    f"{e} at step {step + 1}; stopped before updating the weights."
                    f" Last good checkpoint: {good or 'none'}"
                ) from None
            step, cursor = step + 1, cursor + G
            seconds = time.perf_counter() - start
            tokens_per_s = G * S / seconds
            record = {
                "step": step,
                "loss": loss,
                "lr": lr,
                "tokens_per_s": tokens_per_s,
                "mfu": flops * tokens_per_s / (peak * layout.world),
                "grad_norm": grad_norm,
                "aux": aux_loss,
                "expert_load_max_over_mean": load,
                "memory_gib": peak_memory_gib(device),
            }
            if (cfg.log.eval_every and step % cfg.log.eval_every == 0) or step == cfg.train.steps:
                record["val_loss"] = evaluate()
            metrics.write(**record)
            bar.update(1)
            bar.set_postfix(
                loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:,.0f}", mfu=f"{record['mfu']:.1%}",
                load=f"{max(load, default=1):.2f}",
            )  # fmt: skip
            if main and log_every and (step % log_every == 0 or step == last):
                bar.write(log_line(record, cfg.train.steps), file=sys.stderr)
            signum = stop.requested(device)
            if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or step == last or signum:
                path = save(step)
            if signum and step < last:
                bar.close()
                raise Interrupted(signum, step, path)
    bar.close()
    return {
        "step": step,
        "loss": record.get("loss"),
        "val_loss": record.get("val_loss"),
        "run_dir": str(run_dir),
        "metrics": str(run_dir / "metrics.jsonl"),
        "checkpoints": str(ckpt_root),
    }
