"""pith-models: one self-contained file per MoE model family, plus Hugging Face interop.

import pith_models
model = pith_models.build("tiny-moe", device="cpu")          # random init, seed 0
big = pith_models.build("qwen3-30b-a3b")                     # meta device: no memory
print(pith_models.param_count(big))
hf_model = pith_models.from_pretrained("path/to/hf_dir")      # strict load
pith_models.save_pretrained(hf_model, "out_dir")              # bf16, transformers-loadable
"""

import torch
from torch import nn

from pith_models import deepseek_v2, gpt_oss, qwen3_moe
from pith_models.hf import from_pretrained, module_of, save_pretrained

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


def build(name_or_config, device: str | torch.device = "meta", seed: int = 0) -> nn.Module:
    """The model for a name in MODELS or a model Config; initialised (init_weights) unless on meta."""
    if isinstance(name_or_config, str):
        if name_or_config not in MODELS:
            raise ValueError(f"unknown model name {name_or_config!r}; known: {sorted(MODELS)}")
        name_or_config = MODELS[name_or_config]
    module = module_of(name_or_config)
    with torch.device(device):
        model = module.Model(name_or_config)
    if model.lm_head.weight.device.type != "meta":
        module.init_weights(model, seed)
    return model


def param_count(model: nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once); works on the meta device."""
    return sum(p.numel() for p in model.parameters())


__all__ = ["MODELS", "build", "from_pretrained", "param_count", "save_pretrained"]
