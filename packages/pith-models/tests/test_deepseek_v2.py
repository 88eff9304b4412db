"""DeepSeek-V2: staged path == reference, parity with transformers, gradients, routing, configs.

Shape legend: B batch, S sequence, T tokens, V vocabulary, E experts, K top-k, D hidden.
"""

import dataclasses

import pith_models
import pytest
import torch
from pith_engine.executor import LocalExperts, forward
from pith_models import deepseek_v2
from pith_models.deepseek_v2 import Yarn
from safetensors.torch import load_file, save_file
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

# Larger weights than the default init so attention and routing are far from uniform.
CFG = dataclasses.replace(deepseek_v2.TINY, initializer_range=0.2)
PLAIN = dataclasses.replace(CFG, q_lora_rank=None, topk_method="greedy", n_group=None, topk_group=None)
NORM_TOPK = dataclasses.replace(PLAIN, norm_topk_prob=True, yarn=None)
FREQ2 = dataclasses.replace(CFG, num_hidden_layers=4, moe_layer_freq=2)  # dense, dense, MoE, dense


pytestmark = pytest.mark.usefixtures("ops_take_their_torch_path")  # see conftest.py


def make(cfg, seed=0, S=10):
    model = pith_models.build(cfg, device="cpu", seed=seed)
    ids_BS = torch.randint(0, cfg.vocab_size, (2, S), generator=torch.Generator().manual_seed(seed))
    return model, ids_BS


STAGED_CASES = {  # (config, row alignment of the expert groups)
    "lora-group-yarn": (CFG, 1),
    "lora-group-yarn-aligned": (CFG, 4),
    "plain-aligned": (PLAIN, 4),
    "norm": (NORM_TOPK, 1),
    "freq2": (FREQ2, 1),
}


@pytest.mark.parametrize("cfg, align", STAGED_CASES.values(), ids=STAGED_CASES.keys())
def test_staged_forward_equals_reference(cfg, align):
    model, ids_BS = make(cfg)
    ref_BSV = model.reference_forward(ids_BS)
    h_BSD, routings = forward(model, ids_BS, LocalExperts(align))
    assert len(routings) == sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
    torch.testing.assert_close(model.lm_head(h_BSD), ref_BSV, rtol=1e-5, atol=1e-5)


def test_dense_layers_follow_first_k_dense_replace_and_moe_layer_freq():
    kinds = [layer.experts is not None for layer in pith_models.build(FREQ2).layers.values()]
    assert kinds == [False, False, True, False]
    kinds = [layer.experts is not None for layer in pith_models.build(CFG).layers.values()]
    assert kinds == [False, True, True]


def random_hf_model(cfg):
    """transformers' model for cfg with every parameter random (norm weights around 1)."""
    hf = DeepseekV2ForCausalLM(DeepseekV2Config(**cfg.to_hf(), attn_implementation="eager")).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.3 * noise if "norm" in name else 0.2 * noise)
    return hf


HF_CASES = {
    "q-lora, group-limited, yarn": CFG,
    "no q-lora, greedy, yarn": PLAIN,
    "no yarn, tied": dataclasses.replace(CFG, yarn=None, tie_word_embeddings=True),
}


@pytest.mark.parametrize("cfg", HF_CASES.values(), ids=HF_CASES.keys())
def test_logits_match_transformers_on_import_and_export(cfg, tmp_path, hf_round_trip):
    hf_round_trip(random_hf_model(cfg), cfg, tmp_path, S=12)


def test_deepseek_original_config_json_reads_as_the_v2_lite_preset():
    """The config.json DeepSeek published for V2-Lite (transformers 4.33 spelling, remote-code fields)."""
    published = {
        "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV2Config"}, "aux_loss_alpha": 0.001,
        "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944, "kv_lora_rank": 512,
        "max_position_embeddings": 163840, "model_type": "deepseek_v2", "moe_intermediate_size": 1408,
        "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
        "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
        "num_key_value_heads": 16, "pretraining_tp": 1, "q_lora_rank": None, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
        "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 102400,
    }  # fmt: skip
    cfg = deepseek_v2.Config.from_hf(published)
    assert dataclasses.replace(cfg, n_group=None, topk_group=None) == deepseek_v2.DEEPSEEK_V2_LITE


def test_v2_lite_builds_on_meta_with_the_parameter_count_of_transformers():
    model = pith_models.build("deepseek-v2-lite")
    assert all(p.is_meta for p in model.parameters())
    with torch.device("meta"):
        hf = DeepseekV2ForCausalLM(DeepseekV2Config(**deepseek_v2.DEEPSEEK_V2_LITE.to_hf()))
    assert pith_models.param_count(model) == sum(p.numel() for p in hf.parameters()) == 15_706_484_224


def test_backward_gives_finite_gradients_equal_to_the_reference(staged_grads_equal_reference):
    staged_grads_equal_reference(*make(CFG))


def test_group_limited_routing_stays_in_the_best_groups_and_differs_from_greedy():
    model, _ = make(CFG)
    moe = model.layers["1"].mlp
    x_TD = torch.randn(64, CFG.hidden_size, generator=torch.Generator().manual_seed(3))
    limited = moe.route(x_TD)
    G, per_group = CFG.n_group, CFG.n_routed_experts // CFG.n_group
    best_groups_TG = limited.probs_TE.view(-1, G, per_group).amax(-1).topk(CFG.topk_group, -1).indices
    chosen_groups_TK = limited.expert_ids_TK // per_group
    assert (chosen_groups_TK[..., None] == best_groups_TG[:, None, :]).any(-1).all()
    greedy_ids_TK = limited.probs_TE.topk(CFG.num_experts_per_tok, -1).indices
    assert (limited.expert_ids_TK.sort(-1).values != greedy_ids_TK.sort(-1).values).any()
    chosen_TK = limited.probs_TE.gather(1, limited.expert_ids_TK)
    torch.testing.assert_close(limited.weights_TK, chosen_TK * CFG.routed_scaling_factor)


def test_norm_topk_prob_renormalises_without_routed_scaling():
    model, _ = make(dataclasses.replace(NORM_TOPK, routed_scaling_factor=3.0))
    r = model.layers["1"].mlp.route(torch.randn(9, CFG.hidden_size))
    chosen_TK = r.probs_TE.gather(1, r.expert_ids_TK)
    torch.testing.assert_close(r.weights_TK, chosen_TK / chosen_TK.sum(-1, keepdim=True))


def test_expert_bias_steers_selection_but_not_combine_weights():
    model, _ = make(CFG)
    moe = model.layers["1"].mlp
    x_TD = torch.randn(5, CFG.hidden_size)
    plain = moe.route(x_TD)
    moe.expert_bias[6] = 10.0  # larger than any probability gap: expert 6 (and its group) always chosen
    biased = moe.route(x_TD)
    assert (biased.expert_ids_TK == 6).any(-1).all()
    torch.testing.assert_close(biased.probs_TE, plain.probs_TE)
    chosen = biased.probs_TE.gather(1, biased.expert_ids_TK)
    torch.testing.assert_close(biased.weights_TK, chosen * CFG.routed_scaling_factor)
    with pytest.raises(ValueError, match="expert_bias is nonzero"):
        deepseek_v2.to_hf_state_dict(model.state_dict(), CFG)


def test_yarn_scales_the_softmax_and_the_rotary_tables():
    y = CFG.yarn  # mscale 0.9, mscale_all_dim 0.7, factor 4
    m = lambda s: 0.1 * s * torch.log(torch.tensor(4.0, dtype=torch.float64)).item() + 1  # noqa: E731
    assert deepseek_v2.softmax_scale(CFG) == pytest.approx(CFG.qk_head_dim**-0.5 * m(0.7) ** 2)
    _, factor = deepseek_v2.rope_frequencies(CFG, torch.device("cpu"))
    assert factor == pytest.approx(m(0.9) / m(0.7))
    inv_freq_R, _ = deepseek_v2.rope_frequencies(CFG, torch.device("cpu"))
    plain_R, _ = deepseek_v2.rope_frequencies(dataclasses.replace(CFG, yarn=None), torch.device("cpu"))
    assert inv_freq_R[0] == plain_R[0] and inv_freq_R[-1] == pytest.approx(plain_R[-1] / y.factor)


BAD_HF_CONFIGS = [
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope type 'dynamic'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "low_freq_factor": 1.0}}, "low_freq_factor"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"scoring_func": "sigmoid"}, "scoring_func"),
    ({"topk_method": "noaux_tc"}, "topk_method"),
    ({"n_group": 3}, "n_group"),
    ({"e_score_correction_bias": True}, "unsupported deepseek_v2 config fields"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}}, "default rope"),
]


@pytest.mark.parametrize("change, match", BAD_HF_CONFIGS)
def test_unsupported_config_values_are_value_errors(change, match):
    with pytest.raises(ValueError, match=match):
        deepseek_v2.Config.from_hf({**CFG.to_hf(), **change})


def test_missing_config_field_is_a_value_error():
    d = CFG.to_hf()
    del d["kv_lora_rank"]
    with pytest.raises(ValueError, match=r"lacks required fields: \['kv_lora_rank'\]"):
        deepseek_v2.Config.from_hf(d)


def test_missing_or_misshapen_tensor_is_a_value_error_naming_it(tmp_path):
    pith_models.save_pretrained(pith_models.build(CFG, device="cpu"), tmp_path, dtype=torch.float32)
    sd = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    save_file({k: v for k, v in sd.items() if k != name}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=f"missing tensors.*{name}"):
        pith_models.from_pretrained(tmp_path)
    save_file({**sd, name: sd[name][:, :-1].contiguous()}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=f"wrong shapes.*{name}"):
        pith_models.from_pretrained(tmp_path)


def test_invalid_config_is_a_value_error():
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        dataclasses.replace(CFG, qk_rope_head_dim=7)
    with pytest.raises(ValueError, match="topk_group"):
        dataclasses.replace(CFG, topk_group=1)  # 1 group of 2 experts cannot supply top-3
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        dataclasses.replace(PLAIN, num_experts_per_tok=9)


def test_yarn_without_factor_takes_the_context_ratio():
    d = {**CFG.to_hf(), "rope_parameters": {"rope_type": "yarn", "original_max_position_embeddings": 32}}
    assert deepseek_v2.Config.from_hf(d).yarn == Yarn(factor=4.0, original_max_position_embeddings=32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-3), (torch.bfloat16, 1e-2)])
def test_staged_forward_and_backward_through_the_kernels_on_gpu(dtype, tol, kernels_match_reference_on_gpu):
    kernels_match_reference_on_gpu(*make(CFG), dtype, tol)
