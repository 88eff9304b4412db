"""Every preset under configs/ (the repository root) loads and validates, fits its layout on its GPUs
(8, or 1 for a `-1gpu` preset: world = pp*dp*cp*ep, experts over ep, batch over micro-batches and
data ranks), and fits an 80 GB card by `pith-train plan` (pith_train.plan), CARD GiB of it."""

from pathlib import Path

import pytest
from pith_train import plan
from pith_train.config import load_config, model_config

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "configs").glob("*.toml"))
CARD = 79 * plan.GIB  # an 80 GB card (H100, H200 at 80 GB) less what its driver keeps, rounded down


def test_the_presets_are_there():
    names = {p.stem for p in CONFIGS}
    assert {
        "qwen3-30b-a3b-8gpu",
        "deepseek-v2-lite-8gpu",
        "gpt-oss-20b-8gpu",
        "bench-qwen3-4layers-1gpu",
    } <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_a_preset_loads_fits_its_layout_and_its_cards_by_the_plan(path):
    cfg = load_config(str(path))
    assert path.read_text().startswith("#")  # commented: what it runs and how
    p = cfg.parallel
    assert p.pp * p.dp * p.cp * p.ep == (1 if path.stem.endswith("1gpu") else 8)
    m = plan.model_shape(model_config(cfg.model))
    plan.valid(cfg, m)  # experts over ep, batch over micro-batches and data ranks, the pipeline
    out = plan.plan(cfg, m, cuda=True, capacity=CARD)
    assert out.fits, plan.report(cfg, m, out, "an 80 GB card", [])
