"""Qwen3-MoE: the staged path equals the reference, gradients, routing bias, presets.

Shape legend: B batch, S sequence, V vocabulary, E experts, D hidden, N grouped rows.
"""

import copy
import dataclasses
import runpy

import pith_models
import pytest
import torch
from pith_engine.executor import LocalExperts, forward
from pith_models import qwen3_moe

# Larger weights than the default init so attention and routing are far from uniform.
CFG = dataclasses.replace(qwen3_moe.TINY, initializer_range=0.2)
SPARSE_STEP = dataclasses.replace(CFG, mlp_only_layers=(), decoder_sparse_step=2)  # dense, MoE


def make(cfg, seed=0):
    model = pith_models.build(cfg, device="cpu", seed=seed)
    ids_BS = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(seed))
    return model, ids_BS


# align > 1 pads each expert's group: stage 3 must ignore the padding rows.
@pytest.mark.parametrize(
    "cfg, align", [(CFG, 4), (SPARSE_STEP, 1)], ids=["mlp_only_layers-align4", "decoder_sparse_step"]
)
def test_staged_forward_equals_reference(cfg, align):
    model, ids_BS = make(cfg)
    ref_BSV = model.reference_forward(ids_BS)
    h_BSD, routings = forward(model, ids_BS, LocalExperts(align))
    assert len(routings) == sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers)) == 1
    torch.testing.assert_close(model.lm_head(h_BSD), ref_BSV, rtol=1e-5, atol=1e-5)


def test_dense_and_moe_layers_follow_the_hf_rule():
    four = dataclasses.replace(SPARSE_STEP, num_hidden_layers=4)
    assert [layer.experts is not None for layer in pith_models.build(four).layers.values()] == [0, 1, 0, 1]
    four = dataclasses.replace(four, mlp_only_layers=(3,))
    assert [layer.experts is not None for layer in pith_models.build(four).layers.values()] == [0, 1, 0, 0]
    four = dataclasses.replace(four, mlp_only_layers=(0,), decoder_sparse_step=1)
    assert [layer.experts is not None for layer in pith_models.build(four).layers.values()] == [0, 1, 1, 1]


def test_backward_gives_finite_gradients_equal_to_the_reference(staged_grads_equal_reference):
    staged_grads_equal_reference(*make(CFG))


def test_expert_bias_steers_selection_but_not_combine_weights():
    model, ids_BS = make(CFG)
    moe = model.layers["1"].mlp
    x_TD = torch.randn(5, CFG.hidden_size)
    plain = moe.route(x_TD)
    moe.expert_bias[3] = 10.0  # larger than any probability gap: expert 3 is always chosen
    biased = moe.route(x_TD)
    assert (biased.expert_ids_TK == 3).any(-1).all()
    torch.testing.assert_close(biased.probs_TE, plain.probs_TE)
    chosen = biased.probs_TE.gather(1, biased.expert_ids_TK)
    torch.testing.assert_close(biased.weights_TK, chosen / chosen.sum(-1, keepdim=True))


def test_stage3_uses_the_experts_the_module_holds():
    model, _ = make(CFG)
    layer = model.layers["1"]
    held = slice(1, 4)  # what an expert-parallel rank would hold: 3 of the 4 experts
    experts = layer.experts
    experts.w_gate_up = torch.nn.Parameter(experts.w_gate_up[held].detach())
    experts.w_down = torch.nn.Parameter(experts.w_down[held].detach())
    x_ND = torch.randn(7, CFG.hidden_size)
    group_ends_E = torch.tensor([2, 2, 6], dtype=torch.int32)  # expert 1 gets no rows, row 6 is padding
    y_ND = layer.stage3(x_ND, group_ends_E)
    for e, (s, t) in enumerate(zip([0, 2, 2], group_ends_E.tolist())):
        gate, up = (x_ND[s:t].double() @ experts.w_gate_up[e].double()).chunk(2, -1)
        expect = (torch.nn.functional.silu(gate) * up) @ experts.w_down[e].double()
        torch.testing.assert_close(y_ND[s:t].double(), expect, rtol=1e-5, atol=1e-6)


def test_qwen3_30b_a3b_builds_on_meta_with_its_published_size():
    model = pith_models.build("qwen3-30b-a3b")
    assert all(p.is_meta for p in model.parameters())
    # 48 layers x (attention 18,878,720 + router/experts 604,241,920) + 2 x 311,164,928 embeddings + norm
    assert pith_models.param_count(model) == 30_532_122_624


def test_main_prints_parameter_counts(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["pith_models", "qwen3-30b-a3b", "tiny-moe"])
    runpy.run_module("pith_models", run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["qwen3-30b-a3b", "30,532,122,624", "parameters"]
    assert lines[1].startswith("tiny-moe")


def test_tiny_moe_is_a_few_million_parameters_with_a_byte_vocabulary():
    model = pith_models.build("tiny-moe")
    assert model.cfg.vocab_size == 260
    assert 1_000_000 < pith_models.param_count(model) < 10_000_000


def test_init_weights_is_reproducible_and_rejects_meta():
    a, b = pith_models.build(CFG, device="cpu", seed=3), pith_models.build(CFG, device="cpu", seed=3)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    with pytest.raises(ValueError, match="meta"):
        qwen3_moe.init_weights(pith_models.build(CFG), 0)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"mlp_only_layers": (2,)}, "mlp_only_layers"),
        ({"head_dim": 15}, "head_dim"),
    ],
)
def test_bad_config_is_a_value_error(change, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(CFG, **change)


def test_unknown_model_name_is_a_value_error():
    with pytest.raises(ValueError, match="tiny-moe"):
        pith_models.build("no-such-model")


@pytest.mark.gpu
def test_bf16_staged_forward_on_cuda_tracks_the_fp32_reference():
    """The real kernels (Triton ops, SDPA) in bf16 against the fp32 reference of the same weights.
    bf16 may flip a near-tied routing choice for a few tokens, so the logits get a loose bound and
    the loss a tight one."""
    model = pith_models.build(CFG, device="cuda", seed=0)
    ids_BS = torch.randint(0, CFG.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    labels_T = ids_BS.roll(-1, 1).flatten()
    with torch.no_grad():
        expected_BSV = model.reference_forward(ids_BS)
    model_bf16 = copy.deepcopy(model).to(torch.bfloat16)
    h_BSD, _ = forward(model_bf16, ids_BS, LocalExperts(align=8))
    logits_BSV = model_bf16.lm_head(h_BSD).float()
    assert ((logits_BSV - expected_BSV).norm() / expected_BSV.norm()) < 0.1
    loss = torch.nn.functional.cross_entropy(logits_BSV.flatten(0, 1), labels_T)
    expected_loss = torch.nn.functional.cross_entropy(expected_BSV.flatten(0, 1), labels_T)
    assert abs(loss.item() - expected_loss.item()) < 2e-2 * expected_loss.item()
    loss.backward()
    for name, p in model_bf16.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
