"""GPT-OSS: staged path == reference, parity with transformers, gradients (sinks too), experts, configs.

Shape legend: B batch, S sequence, T tokens, V vocabulary, E experts, K top-k, D hidden, N grouped rows.
"""

import dataclasses
import json

import pith_models
import pytest
import torch
import transformers
from hypothesis import given
from hypothesis import strategies as st
from pith_engine.executor import LocalExperts, forward
from pith_models import gpt_oss
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig, GptOssForCausalLM

# Larger weights than the default init so attention, routing and the SwiGLU clamps all matter.
CFG = dataclasses.replace(gpt_oss.TINY, initializer_range=0.2)
S = 12  # longer than CFG.sliding_window, so the sliding layers mask keys the full layers see


pytestmark = pytest.mark.usefixtures("ops_take_their_torch_path")  # see conftest.py


def make(cfg=CFG, seed=0):
    model = pith_models.build(cfg, device="cpu", seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # init_weights zeroes biases; random ones here, so their paths are checked
        for name, p in model.named_parameters():
            if name.endswith(("bias", "b_gate_up", "b_down", "sinks")):
                p.copy_(torch.randn(p.shape, generator=gen))
    ids_BS = torch.randint(0, cfg.vocab_size, (2, S), generator=gen)
    return model, ids_BS


@pytest.mark.parametrize("align", [1, 4])
def test_staged_forward_equals_reference(align):
    model, ids_BS = make()
    ref_BSV = model.reference_forward(ids_BS)
    h_BSD, routings = forward(model, ids_BS, LocalExperts(align))
    assert len(routings) == CFG.num_hidden_layers
    torch.testing.assert_close(model.lm_head(h_BSD), ref_BSV, rtol=1e-5, atol=1e-5)


def test_layers_alternate_sliding_and_full_attention():
    model, ids_BS = make()
    W = CFG.sliding_window
    assert [layer.self_attn.window for layer in model.layers.values()] == [W, None, W]
    # The window changes what late tokens see, not what the first sliding_window tokens see.
    wide = pith_models.build(dataclasses.replace(CFG, sliding_window=S), device="cpu")
    wide.load_state_dict(model.state_dict())
    with torch.no_grad():
        narrow_BSV, wide_BSV = model.reference_forward(ids_BS), wide.reference_forward(ids_BS)
    torch.testing.assert_close(narrow_BSV[:, :W], wide_BSV[:, :W])
    assert (narrow_BSV[:, W:] - wide_BSV[:, W:]).abs().amax() > 1e-3


def random_hf_model(cfg):
    """transformers' model for cfg with every parameter random: norms around 1, sinks, all biases;
    expert weights large enough that the SwiGLU clamps (|x| > 7) engage."""
    hf = GptOssForCausalLM(GptOssConfig(**cfg.to_hf(), attn_implementation="eager")).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            scale = 1.0 if name.endswith(("sinks", "bias")) else 0.8 if "experts.gate_up" in name else 0.2
            p.copy_(1 + 0.3 * noise if "norm" in name else scale * noise)
    return hf


HF_CASES = {
    "yarn, untied": CFG,
    "plain rope, tied": dataclasses.replace(CFG, yarn=None, tie_word_embeddings=True),
}


@pytest.mark.parametrize("cfg", HF_CASES.values(), ids=HF_CASES.keys())
def test_logits_match_transformers_on_import_and_export(cfg, tmp_path, hf_round_trip):
    model = hf_round_trip(random_hf_model(cfg), cfg, tmp_path, S)
    x_TD = model.layers["0"].post_attention_layernorm(model.embed_tokens.weight[:32])
    gate_up_TF = (x_TD @ model.layers["0"].mlp.experts.w_gate_up[0]).detach()
    assert (gate_up_TF.abs() > cfg.swiglu_limit).any()  # the clamps are exercised


def test_backward_gives_finite_gradients_to_every_parameter_sinks_included(staged_grads_equal_reference):
    model, ids_BS = make()
    assert sum(name.endswith("sinks") for name, _ in model.named_parameters()) == CFG.num_hidden_layers
    staged_grads_equal_reference(model, ids_BS)


def test_router_softmaxes_the_chosen_logits_and_expert_bias_only_steers():
    model, _ = make()
    moe = model.layers["0"].mlp
    x_TD = torch.randn(6, CFG.hidden_size)
    r = moe.route(x_TD)
    logits_TE = x_TD @ moe.router.weight.T + moe.router.bias
    torch.testing.assert_close(r.expert_ids_TK, logits_TE.topk(CFG.num_experts_per_tok).indices)
    torch.testing.assert_close(r.weights_TK, logits_TE.topk(CFG.num_experts_per_tok).values.softmax(-1))
    moe.expert_bias[5] = 100.0
    biased = moe.route(x_TD)
    assert (biased.expert_ids_TK == 5).any(-1).all()
    torch.testing.assert_close(biased.weights_TK, logits_TE.gather(1, biased.expert_ids_TK).softmax(-1))
    with pytest.raises(ValueError, match="expert_bias is nonzero"):
        gpt_oss.to_hf_state_dict(model.state_dict(), CFG)


def test_stage3_adds_the_biases_of_the_experts_the_module_holds():
    model, _ = make()
    experts = model.layers["0"].experts
    held = slice(2, 5)  # what an expert-parallel rank would hold: 3 of the 8 experts
    for name, p in list(experts.named_parameters()):
        setattr(experts, name, torch.nn.Parameter(p[held].detach()))
    x_ND = torch.randn(7, CFG.hidden_size)
    group_ends_E = torch.tensor([2, 2, 6], dtype=torch.int32)  # expert 1 gets no rows, row 6 is padding
    y_ND = model.layers["0"].stage3(x_ND, group_ends_E)
    for e, (s, t) in enumerate(zip([0, 2, 2], group_ends_E.tolist())):
        h = x_ND[s:t].double() @ experts.w_gate_up[e].double() + experts.b_gate_up[e].double()
        gate, up = (
            h[:, ::2].clamp(max=CFG.swiglu_limit),
            h[:, 1::2].clamp(-CFG.swiglu_limit, CFG.swiglu_limit),
        )
        act = gate * torch.sigmoid(CFG.swiglu_alpha * gate) * (up + 1)
        expect = act @ experts.w_down[e].double() + experts.b_down[e].double()
        torch.testing.assert_close(y_ND[s:t].double(), expect, rtol=1e-5, atol=1e-5)


def test_gpt_oss_20b_builds_on_meta_with_the_parameter_count_of_transformers():
    model = pith_models.build("gpt-oss-20b")
    assert all(p.is_meta for p in model.parameters())
    with torch.device("meta"):
        hf = GptOssForCausalLM(GptOssConfig(**gpt_oss.GPT_OSS_20B.to_hf()))
    assert pith_models.param_count(model) == sum(p.numel() for p in hf.parameters()) == 20_914_757_184


def test_original_release_config_reads_as_the_20b_preset():
    """openai/gpt-oss-20b's config.json (transformers 4.55 spelling); its MXFP4 quantization_config reads."""
    published = {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
        "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
        "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
        "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
        "output_router_logits": False, "pad_token_id": 199999, "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True,
        "vocab_size": 201088,
    }  # fmt: skip
    assert gpt_oss.Config.from_hf(published) == gpt_oss.GPT_OSS_20B
    mxfp4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
    assert gpt_oss.Config.from_hf({**published, "quantization_config": mxfp4}) == gpt_oss.GPT_OSS_20B
    with pytest.raises(ValueError, match="quantization_config: quant_method 'fp8'"):
        gpt_oss.Config.from_hf({**published, "quantization_config": {"quant_method": "fp8"}})


BAD_HF_CONFIGS = [
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope type 'linear'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "mscale": 0.7}}, "mscale"),
    ({"attention_bias": False}, "attention_bias"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "layer_types"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"use_sliding_window": False}, "unsupported gpt_oss config fields"),
    ({"sliding_window": None}, "sliding_window"),
]


@pytest.mark.parametrize("change, match", BAD_HF_CONFIGS)
def test_unsupported_config_values_are_value_errors(change, match):
    with pytest.raises(ValueError, match=match):
        gpt_oss.Config.from_hf({**CFG.to_hf(), **change})


def test_missing_or_misshapen_tensor_is_a_value_error_naming_it(tmp_path):
    pith_models.save_pretrained(make()[0], tmp_path, dtype=torch.float32)
    sd = load_file(tmp_path / "model.safetensors")
    name = "model.layers.2.self_attn.sinks"
    save_file({k: v for k, v in sd.items() if k != name}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=f"missing tensors.*{name}"):
        pith_models.from_pretrained(tmp_path)
    name = "model.layers.1.mlp.experts.gate_up_proj_bias"
    save_file({**sd, name: sd[name][:-1].contiguous()}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=f"wrong shapes.*{name}"):
        pith_models.from_pretrained(tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-3), (torch.bfloat16, 1e-2)])
def test_staged_forward_and_backward_through_the_kernels_on_gpu(dtype, tol, kernels_match_reference_on_gpu):
    kernels_match_reference_on_gpu(*make(), dtype, tol)


@given(
    st.integers(1, 3),
    st.integers(1, 5),
    st.integers(1, 3),
    st.integers(0, 2**32 - 1),
    st.sampled_from([0, 100, 255]),
)
def test_mxfp4_dequantisation_is_transformers_bit_for_bit(E, O, G, seed, low):
    """Every byte and exponent (the ends too: 2^-127 is subnormal in fp32, 2^128 overflows to inf), in
    fp32 and as bf16."""
    from pith_models.hf import dequantize_mxfp4
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (E, O, G, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(low, 256, (E, O, G), generator=gen).to(torch.uint8)
    ours = dequantize_mxfp4(blocks, scales)
    for dtype, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        assert torch.equal(ours.to(dtype).view(bits), theirs.view(bits)), dtype


def write_mxfp4(model, path, seed=0):
    """model saved as GPT-OSS's release stores it: each expert weight as random MXFP4 `_blocks` and
    `_scales` (exponents near 2^-3), the config with its quantization_config. -> the blocks and scales."""
    pith_models.save_pretrained(model, path, dtype=torch.float32)
    sd, gen, packed = load_file(path / "model.safetensors"), torch.Generator().manual_seed(seed), {}
    for k in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E, I, O = sd.pop(k).shape
        packed[k + "_blocks"] = torch.randint(0, 256, (E, O, I // 32, 16), generator=gen, dtype=torch.uint8)
        packed[k + "_scales"] = torch.randint(121, 127, (E, O, I // 32), generator=gen).to(torch.uint8)
    save_file({**sd, **packed}, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    return packed


def test_an_mxfp4_checkpoint_loads_dequantised_as_transformers_loads_it(tmp_path):
    """GPT-OSS's released layout: pith's load holds transformers' dequantised experts bit for bit and
    gives the logits of transformers' dequantised load."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    cfg = dataclasses.replace(CFG, intermediate_size=64)  # MXFP4 blocks are 32 wide: D and F multiples
    packed = write_mxfp4(make(cfg)[0], tmp_path)
    ours = pith_models.from_pretrained(tmp_path)
    chunked = pith_models.from_pretrained(tmp_path, chunk=1000).state_dict()  # several passes a layer
    assert not [k for k, t in ours.state_dict().items() if not torch.equal(chunked[k], t)]
    dequantize = transformers.Mxfp4Config(dequantize=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, quantization_config=dequantize
    ).eval()
    theirs = hf.state_dict()
    for i in range(cfg.num_hidden_layers):
        for hf_name, name in (("gate_up_proj", "w_gate_up"), ("down_proj", "w_down")):
            k = f"model.layers.{i}.mlp.experts.{hf_name}"
            bf16 = convert_moe_packed_tensors(
                packed[k + "_blocks"], packed[k + "_scales"], dtype=torch.bfloat16
            )
            ours_EIO = ours.state_dict()[f"layers.{i}.mlp.experts.{name}"]
            assert torch.equal(ours_EIO, theirs[k]) and torch.equal(ours_EIO.bfloat16(), bf16), k
    ids_BS = make(cfg)[1]
    with (
        torch.no_grad()
    ):  # fp32 summation order apart, as test_logits_match_transformers_on_import_and_export
        ours_BSV, hf_BSV = ours.reference_forward(ids_BS), hf(ids_BS).logits
    assert ((ours_BSV - hf_BSV).norm() / hf_BSV.norm()).item() <= 1e-5


def test_an_mxfp4_tensor_without_its_scales_is_a_value_error(tmp_path):
    cfg = dataclasses.replace(CFG, intermediate_size=64)
    write_mxfp4(make(cfg)[0], tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj_scales"
    save_file({k: v for k, v in sd.items() if k != name}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="down_proj_blocks without its MXFP4 partner"):
        pith_models.from_pretrained(tmp_path)
