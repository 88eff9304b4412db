"""Every preset under configs/ (the repository root) loads and validates, fits its layout on 8 GPUs
(world = dp*cp*ep, experts over ep, batch over micro-batches and data ranks), and leaves room on an
80 GB card: its fp32 weights, gradients and AdamW moments (16 bytes per parameter, sharded as the
trainer shards them) take at most 80% of it."""

from pathlib import Path

import pith_models
import pytest
from pith_engine.parallel import Layout, check_layout, expert_param_names, num_experts
from pith_train.config import load_config, model_config

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "configs").glob("*.toml"))


def test_the_presets_are_there():
    names = {p.stem for p in CONFIGS}
    assert {
        "qwen3-30b-a3b-8gpu",
        "deepseek-v2-lite-8gpu",
        "gpt-oss-20b-8gpu",
        "bench-qwen3-4layers-1gpu",
    } <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_a_preset_loads_fits_its_layout_and_its_states_fit_80_gb(path):
    cfg = load_config(str(path))
    assert path.read_text().startswith("#")  # commented: what it runs and how
    model = pith_models.build(model_config(cfg.model))  # meta
    p = cfg.parallel
    layout = Layout(pp=p.pp, dp=p.dp, cp=p.cp, ep=p.ep)
    world = 1 if path.stem.endswith("1gpu") else 8
    check_layout(
        layout, world_size=world, num_experts=num_experts(model), seq_len=cfg.data.seq_len,
        global_batch=cfg.train.global_batch, micro_batch=cfg.train.micro_batch,
    )  # fmt: skip
    experts = expert_param_names(model)
    params = dict(model.named_parameters())
    n_expert = sum(params[n].numel() for n in experts)
    n_dense = sum(p.numel() for n, p in params.items() if n not in experts)
    states = 16 * (n_dense / world + n_expert / (layout.ep * layout.dp * layout.cp))
    assert states <= 0.8 * 80e9, f"{path.name}: {states / 2**30:.1f} GiB of weights, gradients, moments"
