"""`prepare-data --chat`: conversations in their tokenizer's chat template (transformers renders it),
with loss_mask.bin, a uint8 per token: 1 on the assistant's."""

import json
from pathlib import Path

import numpy as np

# They travel with the weights (checkpoints, convert); generation_config.json: where generate stops.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def hf_tokenizer(path):
    import transformers

    d = Path(path).parent if Path(path).is_file() else Path(path)
    tok = (d / "tokenizer.json").is_file() and transformers.AutoTokenizer.from_pretrained(d)
    if not (tok and tok.chat_template):
        raise ValueError(f"{path}: expected a tokenizer directory with tokenizer.json and a chat template")
    return tok


def render(tok, messages: list[dict]) -> list[tuple[list[int], np.ndarray]]:
    """-> documents (ids, loss mask): the mask 1 on an assistant turn's tokens, what the conversation up
    to it renders to beyond the turns before it with the generation prompt. One document, unless the
    template renders a turn otherwise once later turns follow (Qwen3's thinking): then one per assistant
    turn, the conversation up to it (pith-train README, prepare-data --chat)."""

    ids = lambda m, p=False: list(
        tok.apply_chat_template(m, add_generation_prompt=p, return_dict=False) if m else []
    )

    whole, docs = ids(messages), []
    mask = np.zeros(len(whole), np.uint8)
    for i in (i for i, m in enumerate(messages) if m["role"] == "assistant"):
        start, upto = ids(messages[:i], True), ids(messages[: i + 1])
        if upto[: len(start)] != start:
            raise ValueError(f"the generation prompt is not how the chat template begins turn {i}")
        mask[len(start) : len(upto)] = 1
        docs.append((upto, (np.arange(len(upto)) >= len(start)).astype(np.uint8)))
    return [(whole, mask)] if all(whole[: len(d)] == d for d, _ in docs) else docs


def prepare_chat(files: list[str], out_dir: str, tokenizer: str, max_tokens: int, drop: bool) -> dict:
    from pith_train.prepare import HFTokenizer, clear_leftover, decompress, jsonl_rows

    out = Path(out_dir).resolve()
    tmp = out.with_name(out.name + ".tmp")
    if out.exists():
        raise ValueError(f"output {out_dir!r} already exists")
    clear_leftover(tmp)
    tok = hf_tokenizer(tokenizer)
    ours = HFTokenizer(str(Path(tok.name_or_path) / "tokenizer.json"))
    tokens, masks, n_cut, n_long = [], [], 0, 0  # documents cut, dropped
    for f in files:
        with open(f, "rb") as raw:
            lines = b"".join(decompress(f, raw)).split(b"\n")
        for n, row in jsonl_rows(lines, f):
            messages = row.get("messages") if isinstance(row, dict) else None
            ok = isinstance(messages, list) and all(
                isinstance(m, dict) and "role" in m and isinstance(m.get("content"), str) for m in messages
            )
            if not ok:
                raise ValueError(f'{f}:{n}: expected {{"messages": [{{"role": ..., "content": "text"}}]}}')
            if messages[:1] and messages[0]["role"] == "assistant":
                raise ValueError(f"{f}:{n}: the assistant speaks first: begin with a system or user turn")
            try:
                docs = render(tok, messages)
            except Exception as e:  # jinja's
                raise ValueError(f"{f}:{n}: the chat template cannot render it ({e})") from None
            for ids, mask in docs:
                if long := len(ids) > max_tokens:  # kept if the cut leaves an assistant token
                    cut = not drop and bool(mask[:max_tokens].any())
                    n_cut, n_long = n_cut + cut, n_long + (not cut)
                if not long or cut:
                    tokens.append(np.asarray(ids[:max_tokens]))
                    masks.append(mask[:max_tokens])
    if not sum(map(np.sum, masks)):
        dropped = f" ({n_long} longer than --max-tokens {max_tokens} dropped)" * (n_long > 0)
        raise ValueError(f"{', '.join(files)}: no assistant token{dropped}: nothing to train on")
    tmp.mkdir(parents=True)
    dtype = np.uint16 if ours.vocab_size <= 1 << 16 else np.uint32
    np.concatenate(tokens).astype(dtype).tofile(tmp / "tokens.bin")
    np.concatenate(masks).tofile(tmp / "loss_mask.bin")
    np.cumsum([len(t) for t in tokens]).astype(np.int64).tofile(tmp / "doc_ends.bin")
    meta = {
        "tokenizer": ours.name, "tokenizer_hash": ours.hash, "vocab_size": ours.vocab_size,
        "eos_id": ours.eos_id, "dtype": np.dtype(dtype).name, "num_tokens": sum(map(len, tokens)),
        "num_docs": len(tokens), "num_files": len(files), "assistant_tokens": int(sum(map(np.sum, masks))),
        "truncated": n_cut, "dropped": n_long,
    }  # fmt: skip
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    tmp.rename(out)
    return meta
