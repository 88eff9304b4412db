"""Tokenizers and `prepare-data` (pith-train README, Commands). No torch import here, so the
tokenizing worker processes start quickly."""

import contextlib
import hashlib
import json
import multiprocessing
import os
import shutil
import sysconfig
from pathlib import Path

import numpy as np
from tqdm import tqdm


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, EOS = 256."""

    vocab_size = 257
    eos_id = 256
    hash = "byte"
    name = "byte"

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer.json; EOS is the first of the usual end-of-text tokens it has."""

    EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.name = str(Path(path).resolve())
        data = Path(path).read_bytes()
        self.hash = hashlib.sha256(data).hexdigest()[:16]
        self.tok = Tokenizer.from_str(data.decode("utf-8"))
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        ids = [self.tok.token_to_id(t) for t in self.EOS_NAMES]
        found = [i for i in ids if i is not None]
        if not found:
            raise ValueError(f"tokenizer {path}: has none of the end-of-text tokens {self.EOS_NAMES}")
        self.eos_id = found[0]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encs = self.tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encs]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


def padded_vocab(vocab_size: int) -> int:
    """The model vocabulary to suggest: a multiple of 64, as the GEMMs (and FP8's 16) prefer."""
    return -(-vocab_size // 64) * 64


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    if spec == "byte":
        return ByteTokenizer()
    if not Path(spec).is_file():
        raise ValueError(f"tokenizer: expected 'byte' or an existing tokenizer.json, got {spec!r}")
    return HFTokenizer(spec)


_worker_tokenizer = None


def _init_worker(spec: str) -> None:
    global _worker_tokenizer  # one tokenizer per worker process, built once
    _worker_tokenizer = load_tokenizer(spec)


def _read_documents(path: str, text_field: str):
    if not path.endswith(".jsonl"):
        yield Path(path).read_text(encoding="utf-8", errors="replace")
        return
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e}); fix or remove that line") from None
            if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
                raise ValueError(f"{path}:{n}: expected a JSON object with a string field {text_field!r}")
            yield row[text_field]


def _tokenize_file(args: tuple[str, str]) -> tuple[np.ndarray, np.ndarray]:
    """-> (every document's tokens, each followed by EOS; each document's length with its EOS)."""
    path, text_field = args
    tok = _worker_tokenizer
    docs = [np.append(ids, tok.eos_id) for ids in tok.encode_batch(list(_read_documents(path, text_field)))]
    if not docs:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(docs), np.asarray([len(d) for d in docs], np.int64)


def find_inputs(paths: list[str]) -> list[str]:
    """Files as given; directories searched (sorted) for .txt and .jsonl files."""
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(str(f) for f in p.rglob("*") if f.suffix in (".txt", ".jsonl") and f.is_file())
        elif p.is_file():
            files.append(str(p))
        else:
            raise ValueError(f"input {str(p)!r} does not exist")
    if not files:
        raise ValueError(f"no .txt or .jsonl files found in {paths}")
    return files


def train_bpe(files: list[str], text_field: str, vocab_size: int, path: Path, progress: bool) -> None:
    """A byte-level BPE (GPT-2's: the 256 bytes, <|endoftext|>, merges) trained on `files`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tok.train_from_iterator((doc for f in files for doc in _read_documents(f, text_field)), trainer)
    tok.save(str(path))


def prepare(
    files: list[str],
    out_dir: str,
    tokenizer: str = "byte",
    text_field: str = "text",
    workers: int | None = None,
    progress: bool = True,
    train_vocab: int = 0,
) -> dict:
    """Tokenize `files` into a packed dataset at `out_dir`; -> its metadata. `train_vocab`: with a BPE
    of that size trained on the files instead of `tokenizer`."""
    out, tmp = Path(out_dir), Path(f"{out_dir}.tmp")
    if out.exists():
        raise ValueError(f"output {out_dir!r} already exists; remove it or choose another")
    if train_vocab and train_vocab < 258:
        raise ValueError(f"--train-tokenizer {train_vocab}: 256 bytes, EOS and one merge need 258 or more")
    tok = None if train_vocab else load_tokenizer(tokenizer)  # fails here, before any writing, on a bad spec
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if train_vocab:
        tokenizer = str(tmp / "tokenizer.json")
        train_bpe(files, text_field, train_vocab, Path(tokenizer), progress)
        tok = load_tokenizer(tokenizer)
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    workers = workers or min(len(files), os.cpu_count() or 1)
    num_tokens, doc_ends = 0, []
    bar = tqdm(total=len(files), unit="file", disable=not progress, desc="tokenizing")
    with open(tmp / "tokens.bin", "wb") as f, contextlib.ExitStack() as stack:
        jobs = [(p, text_field) for p in files]
        if workers > 1:
            # spawn, not fork: the parent may hold torch's threads. imap keeps the file order, so the
            # dataset does not depend on the number of workers.
            pool = stack.enter_context(
                multiprocessing.get_context("spawn").Pool(workers, _init_worker, (tokenizer,))
            )
            results = pool.imap(_tokenize_file, jobs)
        else:  # in-process: no start-up cost, and callable from a script without a __main__ guard
            _init_worker(tokenizer)
            results = map(_tokenize_file, jobs)
        for tokens, lengths in results:
            f.write(tokens.astype(dtype).tobytes())
            doc_ends.append(num_tokens + np.cumsum(lengths))
            num_tokens += len(tokens)
            bar.update(1)
            bar.set_postfix(tokens=f"{num_tokens:,}")
    bar.close()
    np.concatenate(doc_ends or [np.zeros(0, np.int64)]).tofile(tmp / "doc_ends.bin")
    meta = {
        "tokenizer": str(out.resolve() / "tokenizer.json") if train_vocab else tok.name,
        "tokenizer_hash": tok.hash,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "dtype": np.dtype(dtype).name,
        "num_tokens": num_tokens,
        "num_docs": int(sum(len(d) for d in doc_ends)),
        "num_files": len(files),
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    tmp.rename(out)
    return meta


def stdlib_corpus() -> list[str]:
    """The built-in corpus: this Python's top-level standard-library .py files (~4.7 MB on 3.11), sorted."""
    return sorted(str(p) for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
