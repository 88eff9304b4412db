"""pith-models: one self-contained file per MoE model family, plus HF interop (usage: pith-models README)."""

import torch
from pith_engine.parallel import SINGLE, Mesh
from torch import nn

from pith_models import deepseek_v2, gpt_oss, qwen3_moe
from pith_models.hf import build_empty, from_pretrained, module_of, save_pretrained

# The trainer's --model.name values: the one place a model name maps to a config.
MODELS = {
    "tiny-moe": qwen3_moe.TINY_MOE,
    "qwen3-moe-tiny": qwen3_moe.TINY,
    "qwen3-30b-a3b": qwen3_moe.QWEN3_30B_A3B,
    "deepseek-v2-tiny": deepseek_v2.TINY,
    "deepseek-v2-lite": deepseek_v2.DEEPSEEK_V2_LITE,
    "gpt-oss-tiny": gpt_oss.TINY,
    "gpt-oss-20b": gpt_oss.GPT_OSS_20B,
}


def build(
    name_or_config,
    device: str | torch.device = "meta",
    seed: int = 0,
    mesh: Mesh | None = None,
    param_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Initialised unless on meta. mesh: this rank's part only, built on meta first; the same seed
    gives the same global weights under every layout."""
    if isinstance(name_or_config, str):
        if name_or_config not in MODELS:
            raise ValueError(f"unknown model name {name_or_config!r}; known: {sorted(MODELS)}")
        name_or_config = MODELS[name_or_config]
    model = build_empty(name_or_config, device, mesh, param_dtype)
    if next(model.parameters()).device.type != "meta":
        module_of(name_or_config).init_weights(model, seed, mesh or SINGLE)
    return model


def param_count(model: nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once); works on the meta device."""
    return sum(p.numel() for p in model.parameters())


__all__ = ["MODELS", "build", "from_pretrained", "param_count", "save_pretrained"]
