"""`pith-train eval` and `generate`: `model(input_ids)` on one process.

Shape legend: B sequences, S sequence length, V vocabulary.
"""

import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from pith_train.config import Config, load_config, model_config
from pith_train.data import PackedDataset, windows
from pith_train.prepare import ByteTokenizer, HFTokenizer, load_tokenizer


def run_config(path: Path) -> Config | None:
    return load_config(str(path / "config.toml")) if (path / "config.toml").is_file() else None


def run_tokenizer(path: Path, spec: str | None) -> ByteTokenizer | HFTokenizer:
    """The checkpoint's own (its tokenizer.json, or the byte tokenizer its run used), else `spec`."""
    if not path.exists():
        raise ValueError(f"{path} does not exist")
    own, given = None, spec and load_tokenizer(spec)
    if (path / "tokenizer.json").is_file():
        own = load_tokenizer(str(path))
    elif (cfg := run_config(path)) is not None and cfg.data.tokenizer == "byte":
        own = ByteTokenizer()
    if own and given and own.hash != given.hash:
        raise ValueError(
            f"--tokenizer {spec}: not the one {path} was trained with ({own.name}): leave --tokenizer out"
        )
    if own or given:
        return own or given
    model_config(str(path))  # a run directory: refused
    raise ValueError(f"{path} has no tokenizer.json and no run config naming its tokenizer: pass --tokenizer")


def _autocast(device: torch.device):
    return torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def dataset_loss(
    model: nn.Module, ds: PackedDataset, seq_len: int, batch: int, max_windows: int = 0, docs=False
):
    """(mean cross-entropy, label tokens) over the dataset's windows (docs: data.document_mask)."""
    n = min(ds.num_windows(seq_len), max_windows or ds.num_windows(seq_len))
    if n < 1:
        raise ValueError(f"{ds.path} has {len(ds.tokens)} tokens, not one window of --seq-len {seq_len} + 1")
    if seq_len > model.cfg.max_position_embeddings:
        raise ValueError(f"--seq-len {seq_len} is more than the model's {model.cfg.max_position_embeddings}")
    device = model.lm_head.weight.device
    total, count, lines = 0.0, 0, 0
    bar = tqdm(total=n, unit="window", disable=not sys.stderr.isatty())
    for first in range(0, n, batch):
        ids = np.arange(first, min(n, first + batch))
        rows = windows(ds.tokens, seq_len, ids, ds.doc_ends if docs else None, ds.loss_mask)
        inputs_BS, labels_BS, *pos = (t.to(device) for t in rows)
        with _autocast(device):
            logits_BSV = model(inputs_BS, *pos)
        total += F.cross_entropy(
            logits_BSV.float().flatten(0, 1), labels_BS.flatten(), reduction="sum"
        ).item()
        count += int((labels_BS != -100).sum())
        bar.update(len(ids))
        if bar.disable and (ids[-1] + 1) * 10 >= (lines + 1) * n:
            lines += 1
            print(f"{ids[-1] + 1}/{n} windows, loss so far {total / max(count, 1):.4f}", file=sys.stderr)
    bar.close()
    if not count:
        raise ValueError(f"{ds.path}: no label token in the {n} windows (a loss mask all 0)")
    return total / count, count


def top_p_keep(probs_V: Tensor, top_p: float) -> Tensor:
    """Nucleus: the fewest most-probable tokens whose probabilities sum to at least top_p (bool [V])."""
    sorted_V, order_V = probs_V.sort(descending=True)
    before_V = sorted_V.cumsum(0) - sorted_V  # mass of the tokens ranked above each one
    keep_V = torch.zeros_like(probs_V, dtype=torch.bool)
    keep_V[order_V] = before_V < top_p
    keep_V[order_V[0]] = True
    return keep_V


@torch.no_grad()
def generate(
    model: nn.Module, prompt: list[int], max_new_tokens: int, tok: ByteTokenizer | HFTokenizer,
    top_p: float | None = None, temperature: float = 1.0, seed: int = 0,
) -> list[int]:  # fmt: skip
    """Greedy (top_p None) or nucleus sampling among `tok`'s ids (the embedding may pad), up to its EOS.
    No KV cache: each token reruns the window (small models)."""
    device = model.lm_head.weight.device
    generator = torch.Generator(device).manual_seed(seed)
    ids, window = list(prompt), model.cfg.max_position_embeddings
    for _ in range(max_new_tokens):
        with _autocast(device):
            logits_V = model(torch.tensor([ids[-window:]], device=device))[0, -1, : tok.vocab_size].float()
        if top_p is None:
            token = int(logits_V.argmax())
        else:
            probs_V = (logits_V / temperature).softmax(-1)
            probs_V = probs_V * top_p_keep(probs_V, top_p)
            token = int(torch.multinomial(probs_V, 1, generator=generator))
        ids.append(token)
        if token == tok.eos_id:
            break
    return ids[len(prompt) :]
