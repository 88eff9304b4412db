"""AdamW and the learning-rate schedules (linear warmup + cosine decay, and warmup-stable-decay)."""

import math

import torch
from torch import nn

from pith_train.config import Config


def build_optimizer(model: nn.Module, cfg: Config) -> torch.optim.AdamW:
    """AdamW over fp32 parameters; matrices get weight decay, vectors (norm scales, biases) do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    o = cfg.optim
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    on_cuda = params[0].is_cuda
    # fused: one kernel launch for the whole update on CUDA; elsewhere the default (foreach) path.
    return torch.optim.AdamW(
        groups, lr=cfg.train.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=on_cuda or None
    )


def lr_at(step: int, cfg: Config) -> float:
    """The learning rate of update `step` (0-based) out of cfg.train.steps."""
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
