"""Conversations for fine-tuning: JSONL lines `{"messages": [{"role": ..., "content": ...}, ...]}`
rendered by a Hugging Face tokenizer's own chat template (transformers' apply_chat_template) into a
packed dataset whose loss_mask.bin (uint8, one per token) marks the assistant's tokens."""

import json
from pathlib import Path

import numpy as np

# What a Hugging Face tokenizer directory holds; they travel with the weights (checkpoints, convert).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def hf_tokenizer(path: str | Path):
    """transformers' tokenizer of a directory (or of the directory of its tokenizer.json), with a chat
    template."""
    try:
        import transformers
    except ImportError:
        raise ValueError("chat templates are rendered by transformers: pip install transformers") from None
    d = Path(path).parent if Path(path).is_file() else Path(path)
    tok = transformers.AutoTokenizer.from_pretrained(d) if (d / "tokenizer.json").is_file() else None
    if tok is None or not tok.chat_template:
        raise ValueError(f"{path}: expected a tokenizer directory with tokenizer.json and a chat template")
    return tok


def render(tok, messages: list[dict]) -> tuple[list[int], np.ndarray]:
    """The conversation's ids and its 0/1 loss mask: each assistant turn's ids, end of turn included,
    are those its conversation so far renders to beyond what the turns before it render to with the
    generation prompt. Prefixes, not `{% generation %}`: Qwen3's, GPT-OSS's and DeepSeek's released
    templates have no generation tags."""

    def ids(msgs, prompt=False):
        return (
            list(tok.apply_chat_template(msgs, add_generation_prompt=prompt, return_dict=False))
            if msgs
            else []
        )

    whole = ids(messages)
    mask = np.zeros(len(whole), np.uint8)
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start, upto = ids(messages[:i], True), ids(messages[: i + 1])
            if whole[: len(upto)] != upto or upto[: len(start)] != start:
                raise ValueError(
                    f"the chat template renders turn {i} differently once later turns follow: "
                    "its assistant tokens cannot be found by rendering prefixes"
                )
            mask[len(start) : len(upto)] = 1
    return whole, mask


def prepare_chat(files: list[str], out_dir: str, tokenizer: str, max_tokens: int, drop: bool) -> dict:
    """Render the conversations of `files` into a dataset at out_dir; one of more than max_tokens
    tokens is cut to them, or dropped if `drop`. -> its meta.json."""
    from pith_train.prepare import HFTokenizer

    out, tmp = Path(out_dir), Path(f"{out_dir}.tmp")
    if out.exists():
        raise ValueError(f"output {out_dir!r} already exists; remove it or choose another")
    tok = hf_tokenizer(tokenizer)
    ours = HFTokenizer(str(Path(tok.name_or_path) / "tokenizer.json"))
    tokens, masks, cut, dropped = [], [], 0, 0
    for f in files:
        for n, line in enumerate(Path(f).read_text(encoding="utf-8").splitlines(), 1):
            messages = json.loads(line).get("messages") if line.strip() else None
            if not isinstance(messages, list) or not all({"role", "content"} <= set(m) for m in messages):
                raise ValueError(f'{f}:{n}: expected {{"messages": [{{"role": ..., "content": ...}}, ...]}}')
            ids, mask = render(tok, messages)
            if len(ids) > max_tokens:
                cut, dropped = cut + (not drop), dropped + drop
                if drop:
                    continue
            tokens.append(np.asarray(ids[:max_tokens]))
            masks.append(mask[:max_tokens])
    if not tokens:
        raise ValueError(
            f"no conversations in {files} ({dropped} dropped as longer than {max_tokens} tokens)"
        )
    tmp.mkdir(parents=True)
    dtype = np.uint16 if ours.vocab_size <= 1 << 16 else np.uint32
    np.concatenate(tokens).astype(dtype).tofile(tmp / "tokens.bin")
    np.concatenate(masks).tofile(tmp / "loss_mask.bin")
    np.cumsum([len(t) for t in tokens]).astype(np.int64).tofile(tmp / "doc_ends.bin")
    meta = {
        "tokenizer": ours.name, "tokenizer_hash": ours.hash, "vocab_size": ours.vocab_size,
        "eos_id": ours.eos_id, "dtype": np.dtype(dtype).name, "num_tokens": int(sum(map(len, tokens))),
        "num_docs": len(tokens), "num_files": len(files),
        "assistant_tokens": int(sum(m.sum() for m in masks)),
        "max_tokens": max_tokens, "truncated": cut, "dropped": dropped,
    }  # fmt: skip
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    tmp.rename(out)
    return meta
