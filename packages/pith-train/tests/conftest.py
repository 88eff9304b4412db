"""Shared fixtures: a micro Qwen3-MoE saved as a Hugging Face directory, a small byte-level dataset,
and a config that trains it in a fraction of a second per step.

The trainer's tests exercise the application, not the kernels (pith-ops tests those against their
references), so they run the operators' PyTorch reference path instead of the Triton interpreter,
which is orders of magnitude slower; subprocesses get an environment without TRITON_INTERPRET.
"""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pith_models
import pytest
import torch
from pith_models import qwen3_moe
from pith_train.config import load_config
from pith_train.prepare import prepare, stdlib_corpus

# Byte vocabulary (257) fits; 2 MoE layers of 4 experts, top-2.
MICRO = qwen3_moe.Config(
    vocab_size=260, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
    norm_topk_prob=True, rope_theta=10_000.0, max_position_embeddings=64,
)  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _reference_ops(reference_ops):  # the repository conftest's
    yield


@pytest.fixture(scope="session")
def subprocess_env():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    return env


@pytest.fixture(scope="session")
def pretrains_in_ranks(run_ranks):
    """pretrains_in_ranks(nproc, [(run_dir, overrides or a pretrains.py object), ...]): nproc processes
    under torchrun's environment variables (conftest's run_ranks: forked from a process that has
    imported torch, whose import costs more than training the micro model) train each run in turn
    (pretrains.py); fails with every rank's output if any run fails. The rank logs go next to the first
    run's directory."""

    def pretrains(nproc: int, runs: list[tuple[Path, list[str] | dict]], timeout: float = 900) -> None:
        args = [json.dumps(o if isinstance(o, dict) else ["--run-dir", str(run), *o]) for run, o in runs]
        run_ranks(Path(__file__).with_name("pretrains.py"), nproc, runs[0][0].parent, *args, timeout=timeout)

    return pretrains


@pytest.fixture(scope="session")
def micro_hf(tmp_path_factory):
    """A Hugging Face directory (fp32 safetensors) of the micro model."""
    path = tmp_path_factory.mktemp("micro_hf")
    pith_models.save_pretrained(pith_models.build(MICRO, "cpu", seed=0), path, dtype=torch.float32)
    return path


@pytest.fixture(scope="session")
def byte_data(tmp_path_factory):
    """A byte-level dataset of three small standard-library files (~9K tokens)."""
    out = tmp_path_factory.mktemp("data") / "bytes"
    prepare(stdlib_corpus()[:3], str(out), "byte", progress=False, workers=1)
    return out


def write_short_docs(path: Path, n: int, seed: int, longest: int = 11) -> Path:
    """A byte-level dataset of n documents of 0-`longest` bytes (plus EOS) of the standard library's text."""
    import random

    rng, text = random.Random(seed), Path(stdlib_corpus()[0]).read_text()
    starts = (rng.randrange(len(text) - longest - 1) for _ in range(n))
    docs = path.with_suffix(".jsonl")
    docs.write_text(
        "".join(json.dumps({"text": text[i : i + rng.randint(0, longest)]}) + "\n" for i in starts)
    )
    prepare([str(docs)], str(path), "byte", progress=False, workers=1)
    return path


@pytest.fixture(scope="session")
def short_docs(tmp_path_factory):
    """write_short_docs of 800 documents: windows of 16 or more tokens cross several documents."""
    return write_short_docs(tmp_path_factory.mktemp("data") / "short_docs", 800, 1)


@pytest.fixture(scope="session")
def tiny_docs(tmp_path_factory):
    """write_short_docs of 5000 documents of 1-3 tokens (~10K tokens)."""
    return write_short_docs(tmp_path_factory.mktemp("data") / "tiny_docs", 5000, 2, 2)


@pytest.fixture(scope="session")
def bad_data(byte_data, tmp_path_factory):
    """byte_data with its middle token 300, past the micro model's vocabulary, and no max_token_id in
    meta.json (as datasets prepared before it was recorded: the check reads the tokens)."""
    bad = tmp_path_factory.mktemp("data") / "bad"
    shutil.copytree(byte_data, bad)
    meta = json.loads((bad / "meta.json").read_text())
    meta.pop("max_token_id", None)
    (bad / "meta.json").write_text(json.dumps(meta))
    tokens = np.memmap(bad / "tokens.bin", dtype=meta["dtype"], mode="r+")
    tokens[len(tokens) // 2] = 300
    tokens.flush()
    return bad


@pytest.fixture(scope="session")
def micro_args(micro_hf, byte_data):
    """Overrides for 6 steps of 4 sequences of 32 tokens in 2 micro-batches, checkpoints every 2 steps,
    the routing bias trained."""
    return [
        f"--model.name={micro_hf}",
        f"--data.path={byte_data}",
        "--data.seq_len=32",
        "--data.val_windows=4",
        "--train.steps=6",
        "--train.global_batch=4",
        "--train.micro_batch=2",
        "--train.lr=1e-2",
        "--train.z_loss_coef=1e-3",
        "--train.bias_rate=1e-2",  # off by default; on here so resume, checkpoints and convert carry it
        "--optim.warmup_steps=2",
        "--checkpoint.every=2",
        "--log.progress=false",
        "--log.eval_every=0",
    ]


@pytest.fixture(scope="session")
def micro_config(micro_args):
    return lambda *overrides: load_config(None, [*micro_args, *overrides])


# ChatML, as Qwen's templates write it: each turn <|im_start|>role\ncontent<|im_end|>\n.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="session")
def chat_tokenizer(tmp_path_factory):
    """A Hugging Face tokenizer directory made with the tokenizers library: the 256 bytes (byte-level, no
    merges) and <|endoftext|>, <|im_start|>, <|im_end|> (259 ids, within the tiny models' 260), with a
    chat template in tokenizer_config.json and <|im_end|> as its EOS, as Qwen3's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path = tmp_path_factory.mktemp("chat_tokenizer")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(path / "tokenizer.json"))
    special = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE, **special}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "special_tokens_map.json").write_text(json.dumps(special))
    return path


def make_conversations(n: int, seed: int = 0) -> list[dict]:
    """n conversations of 1 to 3 exchanges, some with a system turn, of varied lengths."""
    import random

    rng, words = (
        random.Random(seed),
        ["the", "a", "MoE", "expert", "router", "token", "loss", "mask", "turn", "chat", "model"],
    )
    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
        for _ in range(rng.randint(1, 3)):
            for role in ("user", "assistant"):
                msgs.append({"role": role, "content": " ".join(rng.choices(words, k=rng.randint(2, 12)))})
        out.append({"messages": msgs})
    return out


@pytest.fixture(scope="session")
def conversations():
    return make_conversations


@pytest.fixture(scope="session")
def chat_data(chat_tokenizer, tmp_path_factory):
    """60 conversations (~10K tokens, ~30% of them the assistant's) prepared with --chat."""
    from pith_train.chat import prepare_chat

    root = tmp_path_factory.mktemp("chat_data")
    (root / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in make_conversations(60)))
    prepare_chat([str(root / "chats.jsonl")], str(root / "data"), str(chat_tokenizer), 4097, drop=False)
    return root / "data"
