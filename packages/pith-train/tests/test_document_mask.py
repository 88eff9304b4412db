"""Document-masked packing (data.document_mask): a packed window trains exactly as its documents one by
one. (a) Pith's model on a packed window (positions restarting at each document) gives each
document's logits and gradients as the document run alone, for all three families, staged path and
reference, fp32 CPU; (b) a `transformers` model evaluating each document alone gives Pith's per-token
losses on the packed, masked window the loader makes; the loader's positions and labels against a
direct reading of doc_ends; the attention paths against the reference on CUDA (gpu).
"""

import numpy as np
import pith_models
import pytest
import torch
import torch.nn.functional as F
import transformers
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pith_engine.attention import attention
from pith_engine.attention_kernels import attention_reference
from pith_engine.contract import Positions
from pith_models import deepseek_v2, gpt_oss, qwen3_moe
from pith_train.data import windows

S = 12
FAMILIES = {"qwen3_moe": qwen3_moe.TINY, "deepseek_v2": deepseek_v2.TINY, "gpt_oss": gpt_oss.TINY}
RTOL = 1e-5


@pytest.fixture(scope="module")
def models():
    return {name: pith_models.build(cfg, "cpu", seed=0) for name, cfg in FAMILIES.items()}


def doc_positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def cuts_to_lengths(cuts: set[int]) -> list[int]:
    edges = [0, *sorted(cuts), S]
    return [b - a for a, b in zip(edges, edges[1:])]


@settings(max_examples=4, deadline=None)
@given(cuts=st.sets(st.integers(1, S - 1), max_size=5), family=st.sampled_from(sorted(FAMILIES)))
@example(cuts=set(), family="gpt_oss")  # one document spans the window
@example(cuts={1, 2, S - 1}, family="gpt_oss")  # one-token documents, sliding window and sinks
@example(cuts={1, 7}, family="deepseek_v2")
@example(cuts={S - 1, 5}, family="qwen3_moe")
def test_a_packed_window_gives_each_documents_logits_and_gradients_as_alone(models, cuts, family):
    model, lengths = models[family], cuts_to_lengths(cuts)
    g = torch.Generator().manual_seed(len(cuts))
    ids_S = torch.randint(0, model.cfg.vocab_size, (S,), generator=g)
    w_SV = torch.randn(S, model.cfg.vocab_size, generator=g)  # a loss weighing every logit
    params = list(model.parameters())
    for forward in (model, model.reference_forward):
        packed = forward(ids_S[None], doc_positions(lengths)[None])[0]
        packed_grads = torch.autograd.grad((packed * w_SV).sum(), params, allow_unused=True)
        alone, alone_grads = [], [torch.zeros_like(p) for p in params]
        for ids, w in zip(ids_S.split(lengths), w_SV.split(lengths)):
            logits = forward(ids[None])[0]
            alone.append(logits.detach())
            grads = torch.autograd.grad((logits * w).sum(), params, allow_unused=True)
            for acc, gr in zip(alone_grads, grads):
                if gr is not None:
                    acc += gr
        assert rel(packed.detach(), torch.cat(alone)) <= RTOL, (family, lengths)
        for p, got, want in zip(params, packed_grads, alone_grads):
            if got is not None:
                assert rel(got, want) <= RTOL, (family, lengths, p.shape)


@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=12), seq_len=st.integers(1, 16))
def test_window_positions_restart_at_each_document_and_crossing_labels_are_ignored(lengths, seq_len):
    doc_ends = np.cumsum(lengths)
    tokens = np.arange(doc_ends[-1]) % 251
    n = (len(tokens) - 1) // seq_len
    if n < 1:
        return
    ids = np.arange(n)
    inputs_BS, labels_BS, pos_BS = windows(tokens, seq_len, ids, doc_ends)
    plain_in, plain_labels = windows(tokens, seq_len, ids)
    assert torch.equal(inputs_BS, plain_in)
    doc_of = np.searchsorted(doc_ends, np.arange(len(tokens)), side="right")  # each token's document
    for b, i in enumerate(ids):
        for t in range(seq_len):
            g = i * seq_len + t
            first = max(i * seq_len, doc_ends[doc_of[g] - 1] if doc_of[g] else 0)
            assert pos_BS[b, t] == g - first
            crossing = doc_of[g + 1] != doc_of[g]
            assert labels_BS[b, t] == (-100 if crossing else plain_labels[b, t])


QWEN = transformers.Qwen3MoeConfig(
    vocab_size=260, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
    norm_topk_prob=True, mlp_only_layers=[], max_position_embeddings=64, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}, attn_implementation="eager",
    experts_implementation="eager",
)  # fmt: skip
GPT_OSS = transformers.GptOssConfig(
    vocab_size=260, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=3,
    layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64,
    tie_word_embeddings=False, attn_implementation="eager", experts_implementation="eager",
    rope_parameters={"rope_type": "yarn", "rope_theta": 150_000.0, "factor": 4.0,
                     "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False},
)  # fmt: skip


@pytest.mark.parametrize("hf_cfg", [QWEN, GPT_OSS], ids=["qwen3_moe", "gpt_oss"])
def test_b_transformers_on_each_document_alone_gives_pith_packed_per_token_losses(hf_cfg, tmp_path):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    model = pith_models.from_pretrained(tmp_path).float()
    lengths, seq_len = [5, 1, 9, 3, 14, 2, 7], 16  # documents crossing windows, one of one token
    doc_ends = np.cumsum(lengths)
    tokens = np.random.default_rng(0).integers(0, 256, doc_ends[-1])
    ids = np.arange((len(tokens) - 1) // seq_len)
    inputs_BS, labels_BS, pos_BS = windows(tokens, seq_len, ids, doc_ends)
    with torch.no_grad():
        logits_BSV = model(inputs_BS, pos_BS)
        pith_BS = F.cross_entropy(logits_BSV.transpose(1, 2), labels_BS, reduction="none")
        for b in range(len(ids)):
            starts = [*torch.nonzero(pos_BS[b] == 0).flatten().tolist(), seq_len]
            for a, e in zip(starts, starts[1:]):  # each document's piece in the window, alone
                hf_logits = hf(input_ids=inputs_BS[b : b + 1, a:e]).logits[0]
                want = F.cross_entropy(hf_logits, labels_BS[b, a:e], reduction="none")
                assert rel(pith_BS[b, a:e], want) <= RTOL, (b, a, e)
    assert (labels_BS == -100).any() and (pos_BS[:, 1:] == 0).any()  # boundaries inside windows


@pytest.mark.gpu
@pytest.mark.parametrize("window, sinks", [(None, False), (100, True)])
def test_cuda_flex_path_with_documents_matches_the_reference(window, sinks):
    """bf16 flex_attention under a document block mask (SDPA's place without a window) against fp32."""
    g = torch.Generator(device="cuda").manual_seed(0)
    B, L, Hq, Hk, D = 2, 512, 8, 2, 64
    lengths = [[1, 200, 11, 300], [512]]
    pos_BS = torch.stack([doc_positions(n) for n in lengths]).cuda()
    doc_BS = (pos_BS == 0).cumsum(1)
    q, k, v = (
        torch.randn(B, L, h, D, generator=g, device="cuda", dtype=torch.bfloat16) for h in (Hq, Hk, Hk)
    )
    sinks_H = torch.randn(Hq, generator=g, device="cuda") if sinks else None
    dout = torch.randn(B, L, Hq, D, generator=g, device="cuda", dtype=torch.bfloat16)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    pos = Positions(pos_BS, None, None, None, doc_BS)
    out = attention(q, k, v, pos, scale=D**-0.5, window=window, sinks_H=sinks_H)
    grads = torch.autograd.grad(out, leaves, dout)
    ref, _ = attention_reference(
        *(t.float() for t in (q, k, v)), pos_BS, pos_BS, scale=D**-0.5, window=window, sinks_H=sinks_H,
        docs=(doc_BS, doc_BS),
    )  # fmt: skip
    ref_grads = torch.autograd.grad(ref, leaves, dout.float())
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        assert rel(got.float(), want) <= 3e-2, name


@pytest.mark.distributed
def test_document_masked_training_under_cp2_equals_one_process(
    micro_config, micro_args, pretrains_in_ranks, short_docs, tmp_path
):
    """A deterministic case the config-space draw may miss: documents of 0-11 bytes (plus EOS) span
    the zigzag chunks of cp=2, which trains like one process (fp32, rel 1e-5)."""
    import json

    from pith_train.train import pretrain

    args = [f"--data.path={short_docs}", "--data.document_mask=true", "--data.seq_len=16"]
    args += ["--train.steps=3", "--checkpoint.every=0", "--log.tensorboard=false", "--optim.eps=1e-3"]
    pretrain(micro_config(*args), tmp_path / "one")
    layouts = {"cp2": ["--parallel.cp=2"]}
    pretrains_in_ranks(2, [(tmp_path / name, [*micro_args, *args, *o]) for name, o in layouts.items()])

    def losses(run):
        return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]

    want = losses(tmp_path / "one")
    for name in layouts:
        got = losses(tmp_path / name)
        assert len(got) == 3 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, want)), (
            name,
            got,
            want,
        )
