"""AdamW (gradient clipping folded into its update), the optimizers of a model, the lr schedules."""

import math

import pith_ops
import torch
from pith_engine.parallel import expert_param_names, to_local
from torch import Tensor, nn

from pith_train.config import Config
from pith_train.muon import Chain, Muon, hidden_matrices


class AdamW(torch.optim.AdamW):
    """torch's AdamW by pith_ops.adamw_: `step(grad_scale=coef)` scales the gradients inside the update
    (clipping, and rewriting kept casts and FP8 copies, in the same pass) and skips it where coef is
    not finite, with no host sync."""

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        pith_ops.keep_grads(p for group in self.param_groups for p in group["params"])

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                pith_ops.drop_grad(p)

    @torch.no_grad()
    def step(self, closure=None, grad_scale: Tensor | None = None):
        for group in self.param_groups:
            live = [(p, g) for p in group["params"] if (g := pith_ops.grad(p)) is not None]
            if not live:
                continue
            device = to_local(live[0][0]).device
            scale = torch.ones(1, device=device) if grad_scale is None else grad_scale
            for p, _ in live:
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), device=device)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                # A plain torch AdamW's checkpoint holds its counts on the host.
                state["step"] = state["step"].to(device, torch.float32)
            steps = torch.stack([self.state[p]["step"] for p, _ in live]) + 1
            beta1, beta2 = group["betas"]
            constants = pith_ops.step_constants(group["lr"], beta1, beta2, steps)
            for (p, grad), bias in zip(live, constants):
                state, w = self.state[p], to_local(p)
                pith_ops.adamw_(
                    w, *(to_local(t) for t in (grad, state["exp_avg"], state["exp_avg_sq"])), scale,
                    lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                    eps=group["eps"], step=bias, copy=pith_ops.kept_copy(w),
                    fp8=pith_ops.kept_copy(w, torch.float8_e4m3fn),
                )  # fmt: skip
            taken = torch.isfinite(scale).float().reshape(())
            torch._foreach_add_([self.state[p]["step"] for p, _ in live], taken)


def build_optimizer(model: nn.Module, cfg: Config) -> AdamW | Chain:
    """AdamW, weight decay on matrices only (GPT-OSS's stacked b_down [E, D] is E vectors); Muon first
    under optim.name = "muon"."""
    experts = expert_param_names(model)
    o = cfg.optim
    matrices = hidden_matrices(model) if o.name == "muon" else []
    taken = {id(p) for p in matrices}
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in taken]
    matrix = {n: p.ndim - (n in experts) >= 2 for n, p in named}
    groups = [
        {"params": [p for n, p in named if matrix[n]], "weight_decay": o.weight_decay},
        {"params": [p for n, p in named if not matrix[n]], "weight_decay": 0.0},
    ]
    adamw = AdamW(groups, lr=cfg.train.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    if not matrices:
        return adamw
    ns_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[o.muon_ns_dtype]
    return Chain(adamw, Muon(matrices, cfg.train.lr, o.muon_momentum, o.weight_decay, ns_dtype))


def lr_at(step: int, cfg: Config) -> float:
    """The learning rate of update `step` (0-based)."""
    o, peak, total = cfg.optim, cfg.train.lr, cfg.train.steps
    low = peak * o.min_lr_ratio
    if step < o.warmup_steps:
        return peak * (step + 1) / o.warmup_steps
    if o.schedule == "cosine":
        progress = (step - o.warmup_steps) / max(1, total - 1 - o.warmup_steps)
        return low + (peak - low) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    decay_steps = round(o.decay_fraction * total)
    decay_start = max(o.warmup_steps, total - decay_steps)
    if step < decay_start:
        return peak
    return peak - (peak - low) * (step - decay_start + 1) / max(1, total - decay_start)
