"""Hugging Face interop for Qwen3-MoE: parity with transformers both ways, strict loading, errors.

Shape legend: B batch, S sequence, V vocabulary.
"""

import collections
import dataclasses
import json
import math
import os

import pith_models
import pytest
import torch
from pith_models import deepseek_v2, gpt_oss, hf, qwen3_moe
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

CFG = qwen3_moe.TINY
# The other branches: decoder_sparse_step, tied embeddings, unnormalised top-k weights.
SPARSE_STEP_TIED = dataclasses.replace(
    CFG, mlp_only_layers=(), decoder_sparse_step=2, tie_word_embeddings=True, norm_topk_prob=False
)


def hf_model(cfg, seed=0):
    """transformers' Qwen3MoeForCausalLM with random weights, norm weights included (init makes them 1)."""
    d = cfg.to_hf()
    config = transformers.AutoConfig.for_model(**d)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model


def ids(cfg):
    return torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe_hf")
    hf_model(CFG).save_pretrained(path)
    return path


@pytest.mark.parametrize("cfg", [CFG, SPARSE_STEP_TIED], ids=["mlp_only_layers", "sparse_step_tied"])
def test_logits_match_transformers_after_import_and_export(cfg, tmp_path):
    theirs = hf_model(cfg)
    theirs.save_pretrained(tmp_path / "hf")
    ours = pith_models.from_pretrained(tmp_path / "hf")
    assert ours.cfg == cfg
    assert (ours.lm_head.weight is ours.embed_tokens.weight) == cfg.tie_word_embeddings
    input_ids = ids(cfg)
    with torch.no_grad():
        expected_BSV = theirs(input_ids).logits
        assert rel_err(ours.reference_forward(input_ids), expected_BSV) <= 1e-4
        pith_models.save_pretrained(ours, tmp_path / "ours", dtype=torch.float32)
        exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32)
        assert rel_err(exported(input_ids).logits, expected_BSV) <= 1e-4


def test_sharded_checkpoint_loads(tmp_path):
    theirs = hf_model(CFG)
    theirs.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ours = pith_models.from_pretrained(tmp_path)
    input_ids = ids(CFG)
    with torch.no_grad():
        assert rel_err(ours.reference_forward(input_ids), theirs(input_ids).logits) <= 1e-4


def test_save_pretrained_writes_bf16_by_default(hf_dir, tmp_path):
    pith_models.save_pretrained(pith_models.from_pretrained(hf_dir), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert set(tensors) == set(load_file(hf_dir / "model.safetensors"))
    assert qwen3_moe.Config.from_hf(json.loads((tmp_path / "config.json").read_text())) == CFG


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_exported_files_follow_the_umask(hf_dir, tmp_path, umask):
    """safetensors writes its file 0600 whatever the umask (a model others could not read)."""
    old = os.umask(umask)
    try:
        pith_models.save_pretrained(pith_models.from_pretrained(hf_dir), tmp_path / "out")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir()}
    assert modes == {"config.json": 0o666 & ~umask, "model.safetensors": 0o666 & ~umask}


def test_hub_style_config_is_read():
    """The published Qwen3-30B-A3B config.json (transformers 4.x spelling) gives our preset."""
    d = {
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
        "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
        "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
        "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
        "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
        "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    }  # fmt: skip
    assert hf.config_from_hf(d) == qwen3_moe.QWEN3_30B_A3B
    del d["head_dim"]  # transformers' default: hidden_size // num_attention_heads
    assert hf.config_from_hf(d).head_dim == 2048 // 32
    del d["num_experts"]
    with pytest.raises(ValueError, match=r"lacks required fields: \['num_experts'\]"):
        hf.config_from_hf(d)


def write_modified(hf_dir, tmp_path, change_tensors=None, change_config=None):
    config = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(hf_dir / "model.safetensors")
    if change_tensors:
        change_tensors(tensors)
    if change_config:
        change_config(config)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_directory_without_config_or_weights_is_a_value_error(hf_dir, tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        pith_models.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text((hf_dir / "config.json").read_text())
    with pytest.raises(ValueError, match="model.safetensors"):
        pith_models.from_pretrained(tmp_path)


def test_missing_unexpected_and_misshapen_tensors_are_named(hf_dir, tmp_path):
    def damage(t):
        del t["model.layers.1.mlp.experts.3.up_proj.weight"]
        t["model.layers.1.mlp.extra.weight"] = torch.zeros(2)
        t["model.norm.weight"] = torch.ones(CFG.hidden_size + 1)

    with pytest.raises(ValueError) as err:
        pith_models.from_pretrained(write_modified(hf_dir, tmp_path, change_tensors=damage))
    message = str(err.value)
    assert "missing tensors ['model.layers.1.mlp.experts.3.up_proj.weight']" in message
    assert "unexpected tensors ['model.layers.1.mlp.extra.weight']" in message
    assert f"model.norm.weight: expected ({CFG.hidden_size},), got ({CFG.hidden_size + 1},)" in message


@pytest.mark.parametrize(
    "change, match",
    [
        ({"model_type": "llama"}, "unsupported model_type 'llama'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "'yarn'"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "'linear'"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ],
)
def test_unsupported_config_is_a_value_error(hf_dir, tmp_path, change, match):
    path = write_modified(hf_dir, tmp_path, change_config=lambda c: c.update(change))
    with pytest.raises(ValueError, match=match):
        pith_models.from_pretrained(path)


def test_export_refuses_a_nonzero_expert_bias(hf_dir, tmp_path):
    model = pith_models.from_pretrained(hf_dir)
    model.layers["1"].mlp.expert_bias[0] = 0.5
    with pytest.raises(ValueError, match="expert_bias is nonzero"):
        pith_models.save_pretrained(model, tmp_path)


def test_a_from_hf_state_dict_that_mixes_rows_is_a_value_error_naming_the_tensor(hf_dir, monkeypatch):
    """A sharded load needs every non-expert row to be one HF row; a transposed weight is not."""
    convert = qwen3_moe.from_hf_state_dict

    def transposing(sd, cfg, experts=None):
        out = convert(sd, cfg, experts)
        return {**out, "layers.0.self_attn.o_proj.weight": out["layers.0.self_attn.o_proj.weight"].T}

    monkeypatch.setattr(qwen3_moe, "from_hf_state_dict", transposing)
    with pytest.raises(ValueError, match=r"into layers\.0\.self_attn\.o_proj\.weight .* one HF row per row"):
        pith_models.from_pretrained(hf_dir)


@pytest.mark.parametrize(
    "module", [qwen3_moe, deepseek_v2, gpt_oss], ids=["qwen3_moe", "deepseek_v2", "gpt_oss"]
)
def test_a_load_in_chunks_reads_a_chunk_at_a_time_and_equals_the_whole(module, tmp_path, monkeypatch):
    """from_pretrained(chunk=c) reads and converts at most c elements at a time (a row of each of a
    layer's tensors and one expert's per-expert tensors more), several times per layer, and holds
    bit for bit what a load of a layer at a time (a chunk above any layer's size) holds; so does the
    default chunk."""
    pith_models.save_pretrained(pith_models.build(module.TINY, "cpu", 1), tmp_path)
    whole = pith_models.from_pretrained(tmp_path, chunk=10**9).state_dict()
    shapes, rows = hf.read_safetensors(tmp_path), collections.Counter()
    for k, t in shapes.items():
        rows[k.split(".")[2] if k.startswith("model.layers.") else ""] += t[0].numel()
    expert = sum(t.numel() for k, t in shapes.items() if ".layers.1.mlp.experts.0." in k)
    layer = sum(t.numel() for k, t in shapes.items() if k.startswith("model.layers.1."))
    read, reads = hf.read_safetensors, []

    def counting(path, rows=None):
        sd = read(path, rows)
        reads.extend([sum(t.numel() for t in sd.values())] if rows is not None else [])
        return sd

    monkeypatch.setattr(hf, "read_safetensors", counting)
    chunked = pith_models.from_pretrained(tmp_path, chunk=2000).state_dict()
    assert max(reads) <= 2000 + max(rows.values()) + expert < layer / 2, (reads, layer)
    for got in (chunked, pith_models.from_pretrained(tmp_path).state_dict()):
        assert got.keys() == whole.keys()
        assert not [k for k, t in whole.items() if not torch.equal(got[k], t)]


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [0, 2000])
def test_a_load_onto_cuda_equals_the_cpu_load(tmp_path, chunk):
    """The rows read on the CPU go to the parameters' device (the trainer loads onto its GPU)."""
    pith_models.save_pretrained(pith_models.build(gpt_oss.TINY, "cpu", 1), tmp_path)
    want = pith_models.from_pretrained(tmp_path, chunk=chunk).state_dict()
    got = pith_models.from_pretrained(tmp_path, "cuda", chunk=chunk).state_dict()
    assert got.keys() == want.keys() and all(t.is_cuda for t in got.values())
    assert not [k for k, t in want.items() if not torch.equal(got[k].cpu(), t)]


@pytest.mark.parametrize("module", [qwen3_moe, deepseek_v2, gpt_oss])
def test_a_size_below_one_or_a_float_not_positive_is_refused_naming_the_field(module):
    """A count or size of 0, a negative or non-finite rope_theta or eps: refused when the config is
    made, not as a shape error or a NaN loss later."""
    for name, v in vars(module.TINY).items():
        if isinstance(v, bool) or not isinstance(v, int | float):
            continue
        least = 0 if name == "first_k_dense_replace" else 1  # 0: every layer MoE
        for bad in [least - 1] if isinstance(v, int) else [0.0, -1.0, math.inf, math.nan]:
            with pytest.raises(ValueError, match=name):
                dataclasses.replace(module.TINY, **{name: bad})


@pytest.mark.parametrize("module", [qwen3_moe, deepseek_v2, gpt_oss])
def test_from_hf_refuses_another_familys_model_type_and_reads_its_own_or_none(module):
    d = module.TINY.to_hf()
    assert d["model_type"] == module.Config.model_type and module.Config.from_hf(d) == module.TINY
    assert module.Config.from_hf({k: v for k, v in d.items() if k != "model_type"}) == module.TINY
    with pytest.raises(ValueError, match=f"expected model_type '{module.Config.model_type}', got 'other'"):
        module.Config.from_hf({**d, "model_type": "other"})
    assert d["model_type"] == module.Config.model_type  # the caller's dict is left as it was
