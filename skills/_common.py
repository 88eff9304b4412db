"""Helpers the skill scripts share: the model arguments, building the model, the trainer's training step
(called, not copied, so a skill measures what training runs), the correctness checks
(validate-correctness and add-a-model), and the PASS/FAIL verdict.

A script puts skills/ on sys.path and imports this module. On a machine without CUDA the operators
run their PyTorch references (pith_ops.use_triton) unless TRITON_INTERPRET=1 is set, in which case
Triton's interpreter runs the kernels themselves (about 20x slower; fp32/fp16 only).

Shape legend: B batch, S sequence, T = B*S tokens, D hidden, V vocabulary.
"""

import argparse
import dataclasses
import json
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import pith_models
import pith_ops
import torch
from pith_engine import executor, parallel
from pith_engine.step import (  # the one place the skills import the trainer's step from
    IGNORE_INDEX,
    Stages,
    step_values,
    train_step,
)
from pith_train import plan
from pith_train.config import Config as TrainConfig
from pith_train.optim import build_optimizer
from pith_train.train import model_config, step_settings
from torch import Tensor, nn

GIB = 2**30


def add_model_args(parser: argparse.ArgumentParser, batch: tuple[int, int] = (2, 16)) -> None:
    """Arguments naming a model, changes to its config and a batch (default `batch`: micro_batch, seq_len)."""
    parser.add_argument("model", help="a name in pith_models.MODELS or a Hugging Face directory")
    parser.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE",
        help="change a config field (JSON value), e.g. num_hidden_layers=2; the weights are then random",
    )  # fmt: skip
    parser.add_argument("--micro-batch", type=int, default=batch[0], help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=batch[1], help="tokens per sequence")
    parser.add_argument("--seed", type=int, default=0, help="weights and token ids")


def model_cfg(args: argparse.Namespace):
    """The model config of args.model with every --set FIELD=VALUE applied (validated by the config)."""
    cfg = model_config(args.model)
    changes = {}
    for item in args.set:
        field, eq, text = item.partition("=")
        if not eq or field not in {f.name for f in dataclasses.fields(cfg)}:
            raise ValueError(
                f"--set {item!r}: expected FIELD=VALUE with FIELD a field of {type(cfg).__qualname__}"
            )
        try:
            changes[field] = json.loads(text)
        except json.JSONDecodeError:
            changes[field] = text  # a bare string
    if args.micro_batch < 1 or args.seq_len < 1:
        raise ValueError(f"--micro-batch and --seq-len must be >= 1, got {args.micro_batch}, {args.seq_len}")
    return dataclasses.replace(cfg, **changes)


def device_of(name: str) -> torch.device:
    """auto: CUDA when torch sees a device, else CPU (with the trainer's train.cpu_threads)."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device")
    cuda = name == "cuda" or (name == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    threads = TrainConfig().train.cpu_threads
    if device.type == "cpu" and threads:
        torch.set_num_threads(threads)
    return device


def loads_weights(args: argparse.Namespace) -> bool:
    """A directory given and its config unchanged: its weights are used; otherwise they are random."""
    return args.model not in pith_models.MODELS and not args.set


def build_model(args: argparse.Namespace, device: torch.device) -> nn.Module:
    """The fp32 model of args: the directory's weights (loads_weights) or random ones (seeded), once
    pith-train's plan says a training step of it fits `device` (as pretrain checks before it builds)."""
    cfg, run = model_cfg(args), train_config(args)
    run.train.ac = getattr(args, "ac", "none")
    plan.check(run, cfg, device, "the skill")
    if loads_weights(args):
        return pith_models.from_pretrained(args.model, device=str(device))
    return pith_models.build(cfg, device, args.seed)


def perturb(model: nn.Module, seed: int) -> None:
    """Add N(0, 0.2^2) noise to every parameter: init_weights leaves norms at 1 and biases at 0, and its
    small std makes attention and routing nearly uniform; the noise lets a comparison see mistakes in
    any parameter's use."""
    device = model.lm_head.weight.device
    gen = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen, device=device))


def token_ids(args: argparse.Namespace, vocab: int, device: torch.device) -> Tensor:
    gen = torch.Generator().manual_seed(args.seed)
    return torch.randint(0, vocab, (args.micro_batch, args.seq_len), generator=gen).to(device)


def add_run_args(parser: argparse.ArgumentParser) -> None:
    """How the trainer runs the model (pith_engine.step.Stages)."""
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--compile", action="store_true", help="torch.compile the non-expert stages (CUDA)")
    parser.add_argument("--ac", default="none", choices=["none", "selective", "full"], help="recompute")


def stages_of(model: nn.Module, args: argparse.Namespace) -> Stages:
    """The model's stages as the trainer runs them on one process: bf16 residual stream on CUDA,
    compile, recompute."""
    device = model.lm_head.weight.device
    cuda = device.type == "cuda"
    mesh = parallel.Mesh(parallel.Layout(), device)
    return Stages(model, mesh, args.compile and cuda, args.ac, torch.bfloat16 if cuda else None)


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The trainer's defaults (loss coefficients, AdamW, clipping, bias rate) with one micro-batch of
    args' shape per step, so the aux losses count the tokens the step has."""
    cfg = TrainConfig()
    cfg.train.micro_batch = cfg.train.global_batch = args.micro_batch
    cfg.data.seq_len = args.seq_len
    return cfg


def optimizer_of(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    return build_optimizer(model, cfg)


def train_steps(
    model: nn.Module,
    stages: Stages,
    optimizer: torch.optim.Optimizer,
    ids_BS: Tensor,
    steps: int,
    mark: Callable[[int, str], None],
    cfg: TrainConfig,
) -> float:
    """`steps` calls of the trainer's own step (pith_engine.step.train_step: bf16 autocast on CUDA, fused
    loss, MoE aux losses, gradient clipping, AdamW at the peak lr, the expert-bias update) on one batch.
    mark(step, phase) runs at its phase boundaries, seen through hooks rather than a copy of the step:
    "forward" when the backward reaches lm_head's weight (its first gradient; with tied embeddings the
    end of the backward), "backward" before AdamW's step (after the gradient norm), "optimizer" after
    it (before the gradients are freed). Returns the last loss; a non-finite one raises FloatingPointError."""
    labels_BS = torch.cat([ids_BS[:, 1:], torch.full_like(ids_BS[:, :1], IGNORE_INDEX)], dim=1)
    settings = step_settings(cfg, model)
    step, forward_marked = 0, False

    def head_grad(grad: Tensor) -> None:
        nonlocal forward_marked
        if not forward_marked:
            forward_marked = True
            mark(step, "forward")

    handles = [
        model.lm_head.weight.register_hook(head_grad),
        optimizer.register_step_pre_hook(lambda *_: mark(step, "backward")),
        optimizer.register_step_post_hook(lambda *_: mark(step, "optimizer")),
    ]
    try:
        for current in range(steps):
            step, forward_marked = current, False
            outputs = train_step(stages, optimizer, [(ids_BS, labels_BS)], cfg.train.lr, *settings)
            loss = step_values(*outputs)[0]  # the trainer's one host read of the step's values
    finally:
        for handle in handles:
            handle.remove()
    return loss


def rel_err(a: Tensor, b: Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# fp32 tolerances, relative (norm of the difference over the norm). On CPU staged and reference run the
# same math in another order (measured <= 1e-6 on the tiny presets); transformers computes it otherwise.
# On CUDA the Triton kernels' fp32 tl.dot rounds its inputs to TF32 (10-bit mantissa, ~1e-3 per product):
# bounds set from that, not yet measured.
TOLERANCES = {"cpu": (1e-5, 1e-4), "cuda": (5e-3, 3e-2)}  # device type -> (logits, gradients)
HF_TOL = 1e-4


def correctness(model: nn.Module, ids_BS: Tensor, hf: bool, hf_dir: Path | None = None) -> list[str]:
    """Print the numbers and return what failed: staged forward == reference_forward, every parameter
    gets a finite gradient equal to the reference's, and (hf) logits == transformers' for the same
    weights, read from hf_dir or from our own export."""
    failures = []
    logits_tol, grad_tol = TOLERANCES[ids_BS.device.type]
    params = dict(model.named_parameters())
    labels_T = ids_BS.roll(-1, 1).flatten()
    h_BSD, _ = executor.forward(model, ids_BS, executor.LocalExperts())
    ref_BSV = model.reference_forward(ids_BS)
    err = rel_err(model.lm_head(h_BSD), ref_BSV)
    print(f"staged vs reference logits: relative error {err:.2e} (tolerance {logits_tol:.0e})")
    if not err <= logits_tol:
        failures.append(f"staged logits differ from reference_forward by {err:.2e}")
    loss = pith_ops.linear_cross_entropy(h_BSD.flatten(0, 1), model.lm_head.weight, labels_T)
    ref_loss = torch.nn.functional.cross_entropy(ref_BSV.flatten(0, 1).float(), labels_T)
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    ref_grads = torch.autograd.grad(ref_loss, list(params.values()), allow_unused=True)
    worst, worst_name, zero = 0.0, "", []
    for name, g, g_ref in zip(params, grads, ref_grads):
        if g is None:
            failures.append(f"{name} gets no gradient from the staged forward")
        elif not torch.isfinite(g).all():
            failures.append(f"{name} has a non-finite gradient")
        elif g_ref is None:
            failures.append(f"{name} gets no gradient from reference_forward")
        elif not g_ref.any():
            zero.append(name)
        else:
            e = rel_err(g, g_ref)
            worst, worst_name = max((worst, worst_name), (e, name))
    print(
        f"gradients: {len(params)} parameters, worst relative error vs reference {worst:.2e} ({worst_name})"
    )
    if zero:  # e.g. an expert no token chose: not an error, but it went unchecked
        print(f"  zero in the reference (unchecked; try a longer --seq-len): {zero}")
    if worst > grad_tol:
        failures.append(f"gradient of {worst_name} differs from the reference's by {worst:.2e}")
    if hf:
        failures += hf_parity(model, ids_BS, ref_BSV, hf_dir)
    return failures


def hf_parity(model: nn.Module, ids_BS: Tensor, ref_BSV: Tensor, hf_dir: Path | None) -> list[str]:
    try:
        import transformers
    except ImportError:
        print("HF parity: skipped (transformers is not installed)")
        return []
    with tempfile.TemporaryDirectory() as tmp:
        if hf_dir is None:
            hf_dir = Path(tmp)
            pith_models.save_pretrained(model, hf_dir, dtype=torch.float32)
        try:
            theirs = transformers.AutoModelForCausalLM.from_pretrained(
                hf_dir, dtype=torch.float32, attn_implementation="eager"
            ).to(ids_BS.device)
        except (KeyError, ValueError) as e:  # transformers does not know this model_type
            print(f"HF parity: skipped (transformers {transformers.__version__} cannot load it: {e})")
            return []
        with torch.no_grad():
            err = rel_err(ref_BSV, theirs.eval()(ids_BS).logits)
    name = type(theirs).__name__
    print(f"HF parity: relative error vs transformers' {name} {err:.2e} (tolerance {HF_TOL:.0e})")
    return [] if err <= HF_TOL else [f"logits differ from transformers' by {err:.2e}"]


def verdict(main: Callable[[list[str] | None], tuple[bool, str]]) -> None:
    """Run a skill's main and end the process with `PASS: reason` (exit 0) or `FAIL: reason` (exit 1).
    Bad input (ValueError) fails with its message; anything else prints its traceback first."""
    try:
        ok, reason = main(None)
    except ValueError as e:
        ok, reason = False, f"bad input: {e}"
    except Exception as e:
        traceback.print_exc()
        ok, reason = False, f"{type(e).__name__}: {e}"
    print(f"{'PASS' if ok else 'FAIL'}: {reason}", flush=True)
    sys.exit(0 if ok else 1)
