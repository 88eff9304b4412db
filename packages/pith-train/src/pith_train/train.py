"""`pretrain`: the model and data of a Config, then the loop: each step one
pith_engine.step.train_step (which defines the loss), read with step_values."""

import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import pith_models
import torch
import torch.distributed as dist
from pith_engine import checkpoint, parallel
from pith_engine.fp8 import FP8Switch, fp8_weights, gather_in_fp8, use_fp8
from pith_engine.parallel import held_layers
from pith_engine.step import Aux, Stages, evaluate, step_values, train_step
from pith_models import deepseek_v2
from pith_ops.fp8_grouped_gemm import GROUP_ALIGN
from torch import nn
from tqdm import tqdm

from pith_train import config as config_mod
from pith_train import plan, rundir
from pith_train.chat import TOKENIZER_FILES
from pith_train.config import BLEND_BLOCK, Config, ModelConfig, model_config
from pith_train.data import Blend, PackedDataset, WindowLoader
from pith_train.metrics import MetricsLog, log_line, peak_flops, peak_memory_gib
from pith_train.optim import build_optimizer, lr_at
from pith_train.prepare import load_tokenizer, prepare, stdlib_corpus, tokenizer_file
from pith_train.stopping import Interrupted, StopOnSignal, agreed


def parallel_layout(cfg: Config, device: torch.device) -> parallel.Mesh:
    """This process's place in cfg.parallel (plan.check has checked the layout)."""
    p = cfg.parallel
    return parallel.build_mesh(parallel.Layout(pp=p.pp, dp=p.dp, cp=p.cp, ep=p.ep), device)


def step_settings(cfg: Config, model: nn.Module) -> tuple[Aux, float, float]:
    """train_step's arguments after the learning rate."""
    whole = pith_models.build(model.cfg)  # on meta: every layer, whichever this rank holds
    moe_layers = sum(layer.experts is not None for layer in held_layers(whole).values())
    aux = Aux(cfg.train.lbl_coef, cfg.train.z_loss_coef, max(1, moe_layers))
    return aux, cfg.optim.grad_clip, cfg.train.bias_rate


def apply_fp8(cfg: Config, model: nn.Module, cuda: bool, warn=print) -> None:
    use_fp8(model, cfg.train.fp8, lm_head=cfg.train.fp8_lm_head)
    if cfg.train.fp8_all_gather and not gather_in_fp8(model, experts_only=cfg.train.compile and cuda):
        warn(
            "train.fp8_all_gather: no FP8 weight is sharded by FSDP in this layout (experts: over dp x cp;"
            " the rest over dp x cp x ep, not gathered in FP8 under compile on CUDA): nothing to gather"
        )


def fp8_size_problems(cfg: Config, model_cfg) -> list[str]:
    """What the e4m3 GEMMs would refuse on CUDA: dimensions or micro-batch tokens not multiples of 16."""
    if not (cfg.train.fp8 or cfg.train.fp8_lm_head):
        return []
    model = pith_models.build(model_cfg)
    use_fp8(model, cfg.train.fp8, lm_head=cfg.train.fp8_lm_head)
    bad = [
        f"{prefix}.{name} {tuple(p.shape)}".lstrip(".")
        for prefix, m in model.named_modules()
        if isinstance(m, FP8Switch) and m.fp8
        for name, p in fp8_weights(m)
        if any(n % 16 for n in p.shape[-2:])
    ]
    tokens = cfg.train.micro_batch * cfg.data.seq_len // cfg.parallel.cp
    return bad + ([f"{tokens} tokens a micro-batch"] if tokens % 16 else [])


def trainer_stages(cfg: Config, model: nn.Module, mesh: parallel.Mesh) -> Stages:
    """The model as the trainer runs it (under FP8 expert groups padded to the rows its GEMMs take)."""
    cuda = mesh.device.type == "cuda"
    compile = cfg.train.compile and cuda
    dtype, align = torch.bfloat16 if cuda else None, GROUP_ALIGN if cfg.train.fp8 else 1
    # Weight-gradient delay only where the schedule has bubbles to fill.
    overlap, wgrad = cfg.parallel.overlap, cfg.parallel.wgrad_delay and mesh.layout.pp > 1
    graph = cfg.train.cuda_graph and cuda
    return Stages(model, mesh, compile, cfg.train.ac, dtype, align, overlap, wgrad, graph)


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """6 * N_active + 6 * L * S * H * (Dqk + Dv) (PaLM / TorchTitan): the matrices a token passes
    through (a stacked expert weight at K/E; not the embedding lookup), attention over the full S x S."""
    c = model.cfg
    experts = checkpoint.expert_param_names(model)
    lookup_only = model.embed_tokens.weight is not model.lm_head.weight
    active = 0.0
    for name, p in model.named_parameters():
        if p.ndim < 2 or (lookup_only and p is model.embed_tokens.weight):
            continue
        active += p.numel() * (c.num_experts_per_tok / p.shape[0] if name in experts else 1)
    qk, v = (c.qk_head_dim, c.v_head_dim) if isinstance(c, deepseek_v2.Config) else (c.head_dim, c.head_dim)
    return 6 * active + 6 * c.num_hidden_layers * seq_len * c.num_attention_heads * (qk + v)


def build_model(
    model: ModelConfig | str, device: torch.device, seed: int, mesh: parallel.Mesh = parallel.SINGLE,
    param_dtype: torch.dtype | None = None, alone: bool = False,
) -> nn.Module:  # fmt: skip
    """This rank's part (experts, FSDP shards) of a preset, a Hugging Face directory or a checkpoint
    (`alone`: without the process group, as a mirrored rank reads: DCP gathers to rank 0)."""
    model = ModelConfig(model) if isinstance(model, str) else model
    cfg = model_config(model)
    if model.name in pith_models.MODELS:
        return pith_models.build(cfg, device, seed, mesh, param_dtype)
    if not (Path(model.name) / ".metadata").is_file():
        return pith_models.from_pretrained(model.name, device, mesh, param_dtype)
    built = pith_models.build(cfg, device, seed, mesh, param_dtype)
    checkpoint.load(
        Path(model.name), built, mesh=dataclasses.replace(mesh, reduce_group=None) if alone else mesh
    )
    return built


def open_data(cfg: Config, run_dir: Path, main: bool) -> tuple[list, list]:
    """The datasets and each one's validation dataset (None: windows held out); the built-in corpus
    prepared on first use."""
    tok = load_tokenizer(cfg.data.tokenizer)
    paths = [Path(p) for p in cfg.data.path] or [run_dir / "data"]
    if not cfg.data.path and not (paths[0] / "meta.json").is_file():
        if main:
            prepare(stdlib_corpus(), str(paths[0]), cfg.data.tokenizer, progress=cfg.log.progress)
        if dist.is_initialized():
            dist.barrier()
    if missing := [str(p) for p in paths if not p.exists()]:
        raise ValueError(f"data.path {missing[0]!r} does not exist")
    for v in cfg.data.val_path:
        if Path(v).resolve() in [p.resolve() for p in paths]:
            raise ValueError(f"data.val_path is data.path ({v!r}): choose another dataset or none")
    sets = [PackedDataset(str(p)) for p in paths] + [
        PackedDataset(v, "data.val_path") for v in cfg.data.val_path
    ]
    for ds in sets:
        ds.check_tokenizer(tok)
    return sets[: len(paths)], sets[len(paths) :] or [None] * len(paths)


def pick_device(choice: str, key: str, cpu_threads: int = 0) -> torch.device:
    """auto | cpu | cuda: this process's device (LOCAL_RANK's GPU); on CPU, `cpu_threads` intra-op threads."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{key} is cuda, but torch sees no CUDA device")
    if choice == "cpu" or not torch.cuda.is_available():
        if cpu_threads:
            torch.set_num_threads(cpu_threads)
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))


def pretrain(cfg: Config, run_dir: str | Path, stop_at: int | None = None) -> dict:
    """Train per `cfg` in `run_dir`, resuming from its latest intact checkpoint, up to step `stop_at`
    if given; SIGINT/SIGTERM save and raise Interrupted. -> the last step, losses and paths."""
    device = pick_device(cfg.train.device, "train.device", cfg.train.cpu_threads)
    model_cfg = model_config(cfg.model)
    plan.check(cfg, model_cfg, device, "pretrain CONFIG")  # before anything is built
    mesh = parallel_layout(cfg, device)
    run_dir = Path(run_dir)
    main = not dist.is_initialized() or dist.get_rank() == 0
    ckpt_root = run_dir / "checkpoints"
    warn = tqdm.write if main else lambda text: None
    resume_from = rundir.preflight(cfg, run_dir, model_cfg, mesh, warn)
    init = None  # checkpoint.init_from: (the checkpoint, the data position)
    if resume_from is None and cfg.checkpoint.init_from:
        init = rundir.check_init(cfg, model_cfg.to_hf(), mesh, warn)
    datasets, val_sets = open_data(cfg, run_dir, main)
    for d in datasets + [v for v in val_sets if v is not None]:
        d.check_vocab(V := model_cfg.vocab_size)
    if device.type == "cuda" and (bad := fp8_size_problems(cfg, model_cfg)):
        raise ValueError(
            f"train.fp8 / train.fp8_lm_head on CUDA need multiples of 16, got {', '.join(bad)}: pad the"
            " model (e.g. --model.vocab_size), change data.seq_len or train.micro_batch, or turn FP8 off"
        )
    d, G, S = cfg.data, cfg.train.global_batch, cfg.data.seq_len
    sources = [
        WindowLoader(ds, S, d.val_windows, cfg.train.seed, v, d.document_mask)
        for ds, v in zip(datasets, val_sets)
    ]
    loader, names = Blend(sources, d.weights, cfg.train.seed), [Path(x.path).resolve().name for x in datasets]
    names = names if len(set(names)) == len(names) else [f"{i}_{n}" for i, n in enumerate(names)]
    for name, s, n in zip(names, sources, loader.taken(cfg.train.steps * G)):
        warn(
            f"data {name}: {n} sequences in {cfg.train.steps} steps, {n / s.num_train:.3g} epochs"
            + ", repeated" * (n > s.num_train)
        )
    torch.manual_seed(cfg.train.seed)
    cuda = device.type == "cuda"
    dtype, ckpt = torch.bfloat16 if cuda else None, resume_from or init and init[0]
    if ckpt:  # its weights replace all: model.name (a release, maybe moved) is not read
        model = pith_models.build(model_cfg, device, cfg.train.seed, mesh, dtype)
    else:
        model = build_model(cfg.model, device, cfg.train.seed, mesh, dtype)
    apply_fp8(cfg, model, cuda, warn)
    optimizer = build_optimizer(model, cfg)
    step, cursor = 0, init[1] if init else 0
    if ckpt:  # verified by latest_intact or check_init
        checkpoint.load(ckpt, model, optimizer, mesh, verify=False)
    if resume_from:
        state = rundir.read_json(resume_from / "trainer.json")
        step, cursor = state["step"], state["cursor"]
    if main:  # every check passed: nothing in run_dir changed before
        rundir.write_config(run_dir, cfg)
    data_ids = rundir.data_ids(cfg)
    stages = trainer_stages(cfg, model, mesh)
    settings = step_settings(cfg, model)
    flops = flops_per_token(pith_models.build(model.cfg), cfg.data.seq_len)  # the whole model, on meta
    peak, peak_source = peak_flops(device)
    peak = peak if peak_source.endswith("datasheet") else None  # a measured CPU matmul gave MFU > 100%
    metrics = MetricsLog(run_dir, step, main, cfg.log.tensorboard, cfg.log.wandb, dataclasses.asdict(cfg))
    data_slice = mesh.data_rank, mesh.layout.data_ranks  # which sequences of each batch are this rank's
    last = min(cfg.train.steps, stop_at or cfg.train.steps)
    terminal = sys.stderr.isatty()
    bar = tqdm(
        total=cfg.train.steps, initial=step, disable=not (main and cfg.log.progress and terminal), unit="step"
    )
    log_every = cfg.log.every or (0 if terminal else 1)
    if main:
        mfu = f"peak {peak:.3g} FLOP/s ({peak_source})" if peak else "no MFU (no known peak)"
        bar.write(f"{cfg.model.name} on {device}, from step {step}; {mfu}")

    def save(step: int) -> Path:
        files = {
            "trainer.json": json.dumps({"step": step, "cursor": cursor, "data": data_ids}),
            "config.json": json.dumps(model.cfg.to_hf(), indent=1),
            "config.toml": config_mod.to_toml(cfg),  # what a resume is checked against
        }
        if cfg.data.tokenizer != "byte":  # the run's tokenizer travels with its weights
            files["tokenizer.json"] = (tj := Path(tokenizer_file(cfg.data.tokenizer))).read_bytes().decode()
            for name in TOKENIZER_FILES[1:]:  # its chat template, special tokens, generation config
                if (sibling := tj.with_name(name)).is_file():
                    files[name] = sibling.read_bytes().decode()
        path = checkpoint.save(ckpt_root / f"step_{step:06d}", model, optimizer, files, mesh)
        checkpoint.prune(ckpt_root, cfg.checkpoint.keep)
        return path

    record = {}
    with StopOnSignal() as stop, contextlib.closing(metrics):
        while step < last:
            start = time.perf_counter()
            micro = loader.step_batch(cursor, G, cfg.train.micro_batch, *data_slice)
            # inputs and labels (not document positions); the file changed: check_vocab passed
            if (top := agreed(max(int(x.max()) for batch in micro for x in batch[:2]), device)) >= V:
                saved = save(step) if step else "nothing trained"
                raise ValueError(
                    f"data {', '.join(cfg.data.path) or 'RUN/data'}: token id {top} >= the model's vocabulary"
                    f" {V} in step {step + 1}'s windows; saved step {step} ({saved})"
                )
            lr = lr_at(step, cfg)
            try:
                loss, aux_loss, grad_norm, load = step_values(
                    *train_step(stages, optimizer, micro, lr, *settings)
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
                "step": step, "loss": loss, "lr": lr, "tokens_per_s": tokens_per_s,
                **({"mfu": flops * tokens_per_s / (peak * mesh.layout.world)} if peak else {}),
                "grad_norm": grad_norm, "aux": aux_loss, "expert_load_max_over_mean": load,
                "memory_gib": peak_memory_gib(device),
            }  # fmt: skip
            if len(names) > 1:  # the realised mix so far
                record.update({f"mix/{n}": c / cursor for n, c in zip(names, loader.taken(cursor))})
            signum = agreed(stop.signum, device)  # any rank's: all stop after the same step
            if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or step == last or signum:
                path = save(step)  # before validation: a failure there must not lose the trained step
            try:
                if (cfg.log.eval_every and step % cfg.log.eval_every == 0) or step == cfg.train.steps:
                    val = [
                        evaluate(stages, s.val_batches(cfg.train.micro_batch, *data_slice)) for s in sources
                    ]
                    record["val_loss"] = sum(v * n for v, n in zip(val, loader.counts.tolist())) / BLEND_BLOCK
                    record.update({f"val_loss/{n}": v for n, v in zip(names, val)} if len(val) > 1 else {})
            finally:
                metrics.write(**record)
            bar.update(1)
            bar.set_postfix(
                loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:,.0f}",
                **({"mfu": f"{record['mfu']:.1%}"} if peak else {}), load=f"{max(load, default=1):.2f}",
            )  # fmt: skip
            if main and log_every and (step % log_every == 0 or step == last):
                bar.write(log_line(record, cfg.train.steps), file=sys.stderr)
            if signum and step < last:
                bar.close()
                raise Interrupted(signum, step, path)
    bar.close()
    if len(names) > 1:
        warn(f"realised mix: {dict(zip(names, loader.taken(cursor)))} sequences, weights {d.weights}")
    return {
        "step": step, "loss": record.get("loss"), "val_loss": record.get("val_loss"), "run_dir": str(run_dir),
        "metrics": str(run_dir / "metrics.jsonl"), "checkpoints": str(ckpt_root),
    }  # fmt: skip
