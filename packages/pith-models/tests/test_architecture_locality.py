"""A one-family architecture change, made as a worked example: Qwen3-MoE's experts get a learned
per-expert output scale, in a subclass of qwen3_moe.Experts written here (no source file touched).
The variant computes what it should (its staged path equals its own reference loop, and its experts
equal the unscaled ones times the scale), and the other two families are unchanged by its existence:
DeepSeek-V2's and GPT-OSS's staged logits and their Hugging Face round trip (pith -> HF -> pith) are the
same bit for bit before and after the variant is built and run, and their modules share no class with
Qwen3-MoE's file.

Shape legend: B batch, S sequence, V vocabulary, E experts, D hidden, F expert width, N grouped rows.
"""

import pith_models
import pith_ops
import pytest
import torch
from pith_engine.layers import routed_reference
from pith_models import deepseek_v2, gpt_oss, qwen3_moe
from torch import Tensor, nn

pytestmark = pytest.mark.usefixtures("ops_take_their_torch_path")  # see conftest.py


class ScaledExperts(qwen3_moe.Experts):
    """Qwen3-MoE's SwiGLU experts, each expert's output times its own learned scale."""

    def __init__(self, E: int, D: int, F: int):
        super().__init__(E, D, F)
        self.scale_E = nn.Parameter(torch.ones(E))

    def forward(self, x_ND: Tensor, group_ends_E: Tensor) -> Tensor:
        y_ND = super().forward(x_ND, group_ends_E)
        rows_N = torch.arange(y_ND.shape[0], device=y_ND.device, dtype=group_ends_E.dtype)
        expert_N = torch.searchsorted(group_ends_E, rows_N, right=True).clamp(max=len(group_ends_E) - 1)
        return y_ND * self.scale_E[expert_N, None].to(y_ND.dtype)  # padding rows: any expert's scale

    def reference(self, x_TD: Tensor, expert_ids_TK: Tensor, weights_TK: Tensor) -> Tensor:
        w_gate_up, w_down, scale_E = self.w_gate_up, self.w_down, self.scale_E
        expert = lambda e, x: pith_ops.swiglu_reference(x @ w_gate_up[e]) @ w_down[e] * scale_E[e]
        return routed_reference(x_TD, expert_ids_TK, weights_TK, w_gate_up.shape[0], expert)


def scaled_variant(model: qwen3_moe.Model, scale_E: Tensor) -> qwen3_moe.Model:
    """`model` with every MoE layer's experts a ScaledExperts holding the same weights and `scale_E`."""
    for layer in model.layers.values():
        if layer.experts is not None:
            old = layer.mlp.experts
            layer.mlp.experts = ScaledExperts(*old.w_gate_up.shape[:2], old.w_down.shape[1])
            layer.mlp.experts.load_state_dict({**old.state_dict(), "scale_E": scale_E})
    return model


def ids(cfg) -> Tensor:
    return torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))


def other_families_logits(tmp_path) -> dict[str, Tensor]:
    """DeepSeek-V2's and GPT-OSS's staged logits, and those of their pith -> HF -> pith round trip."""
    out = {}
    for module in (deepseek_v2, gpt_oss):
        model = pith_models.build(module.TINY, "cpu", seed=1)
        path = tmp_path / f"{module.__name__}_{len(list(tmp_path.iterdir()))}"
        pith_models.save_pretrained(model, path, dtype=torch.float32)
        back = pith_models.from_pretrained(path)
        with torch.no_grad():
            out[module.__name__] = model(ids(module.TINY))
            out[f"{module.__name__} via HF"] = back(ids(module.TINY))
        assert torch.equal(out[module.__name__], out[f"{module.__name__} via HF"]), module.__name__
        assert not {type(m).__module__ for m in model.modules()} & {qwen3_moe.__name__, __name__}
    return out


def test_a_per_expert_scale_on_qwen3_moe_changes_it_alone(tmp_path, staged_grads_equal_reference):
    before = other_families_logits(tmp_path)

    cfg = qwen3_moe.TINY
    build = lambda: pith_models.build(cfg, "cpu", seed=0)
    with torch.no_grad():
        base_BSV = build()(ids(cfg))
        unit_BSV = scaled_variant(build(), torch.ones(cfg.num_experts))(ids(cfg))
    assert torch.equal(unit_BSV, base_BSV)  # scale 1: exactly the family as it was

    scale_E = torch.linspace(0.5, 2.0, cfg.num_experts)
    variant = scaled_variant(build(), scale_E)
    with torch.no_grad():
        staged_BSV = variant(ids(cfg))
        torch.testing.assert_close(staged_BSV, variant.reference_forward(ids(cfg)), rtol=1e-5, atol=1e-5)
    assert (staged_BSV - base_BSV).abs().max() > 1e-2  # the scale changed the outputs
    staged_grads_equal_reference(variant, ids(cfg))  # scale_E included: it trains through stage 3

    # Stage 3 by hand: the unscaled experts' rows times the scale of each row's expert.
    layer = next(layer for layer in variant.layers.values() if layer.experts is not None)
    x_ND = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    ends_E = torch.tensor([1, 3, 3, 6], dtype=torch.int32)
    plain = qwen3_moe.Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
    plain.load_state_dict({k: v for k, v in layer.experts.state_dict().items() if k != "scale_E"})
    with torch.no_grad():
        want_ND = plain(x_ND, ends_E) * scale_E[[0, 1, 1, 3, 3, 3], None]
        torch.testing.assert_close(layer.stage3(x_ND, ends_E), want_ND, rtol=0, atol=0)

    after = other_families_logits(tmp_path)
    for name, logits in before.items():
        assert torch.equal(after[name], logits), name
