"""Tokenizers and `prepare-data` (pith-train README, Commands). No torch import here, so the
tokenizing worker processes start quickly."""

import collections
import gzip
import hashlib
import itertools
import json
import multiprocessing
import os
import re
import shutil
import signal
import sys
import sysconfig
import time
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
        encs = self.tok.encode_batch_fast(texts, add_special_tokens=False)  # the ids of encode_batch
        return [np.array(e.ids, dtype=np.int64) for e in encs]

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


# Stages: the parent reads batches of about BATCH_BYTES of text in input order (`_batches`), workers
# parse and tokenize them (`_encode`), the parent appends the results in that order. With at most 2
# batches per worker in flight, memory is bounded by workers x batch and the largest document.
BATCH_BYTES = 1 << 20
COMMIT_BATCHES = 64  # fsync and progress.json every ~64 MB of text: what an interruption loses
KNOWN = re.compile(r"\.(txt|jsonl)(\.gz|\.zst)?$|\.parquet$")


def _given(texts: list[str], path: str, field: str) -> list[str]:
    return texts


def _jsonl_texts(block: bytes, where: tuple[str, int], field: str) -> list[str]:
    """The `field` strings of a block of JSONL lines; `where`: its file and first line number."""
    texts = []
    for n, line in enumerate(block.split(b"\n"), where[1]):
        if line.strip():
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{where[0]}:{n}: not valid JSON ({e}); fix or remove that line") from None
            if not isinstance(row, dict) or not isinstance(row.get(field), str):
                raise ValueError(f"{where[0]}:{n}: expected a JSON object with a string field {field!r}")
            texts.append(row[field])
    return texts


def _file_batches(path: str, field: str):
    """(bytes of `path` read, batch) for each batch of its documents; a batch is (parse, payload,
    where, field), parse(payload, where, field) its texts. Other than .jsonl or .parquet: one text."""
    size = os.path.getsize(path)
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        table, done = pq.ParquetFile(path), 0
        if field not in table.schema_arrow.names:
            raise ValueError(
                f"{path}: no column {field!r} (it has {table.schema_arrow.names}); see --text-field"
            )
        for records in table.iter_batches(1024, columns=[field]):
            texts = records.column(0).to_pylist()
            if not all(isinstance(t, str) for t in texts):
                raise ValueError(f"{path}: column {field!r} holds {set(map(type, texts))}, not only strings")
            done += len(texts)
            yield size * done // table.metadata.num_rows, (_given, texts, path, field)
        return
    with open(path, "rb") as raw:
        f = gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw
        if path.endswith(".zst"):
            import zstandard

            f = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        if not re.search(r"\.jsonl(\.gz|\.zst)?$", path):
            yield size, (_given, [f.read().decode("utf-8", errors="replace")], path, field)
            return
        line, rest = 1, bytearray()
        while True:
            chunk = f.read(BATCH_BYTES)
            rest += chunk  # cut at the last line's end, which only the new chunk can hold
            if cut := rest.rfind(b"\n", len(rest) - len(chunk)) + 1 if chunk else len(rest):
                block = bytes(rest[:cut])
                del rest[:cut]
                yield raw.tell(), (_jsonl_texts, block, (path, line), field)
                line += block.count(b"\n")
            if not chunk:
                return


def _batches(files: list[str], field: str):
    """(input bytes read, batch) over `files` in order: the same batches whatever the workers."""
    done = 0
    for path in files:
        yield from ((done + pos, batch) for pos, batch in _file_batches(path, field))
        done += os.path.getsize(path)


_tok = None


def _init_worker(spec: str, pool: bool) -> None:
    global _tok  # one tokenizer per worker process, built once
    # One thread each: the workers are the parallelism (N processes of N threads oversubscribe).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if pool:  # Ctrl-C reaches the whole process group; the parent stops the pool
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    _tok = load_tokenizer(spec)


def _dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def _encode(batch: tuple) -> tuple[np.ndarray, np.ndarray]:
    """-> (the batch's documents' tokens, each followed by EOS, in the dataset's dtype; their lengths)."""
    parse, *args = batch
    docs = [np.append(ids, _tok.eos_id) for ids in _tok.encode_batch(parse(*args))]
    tokens = np.concatenate(docs) if docs else np.zeros(0, np.int64)
    return tokens.astype(_dtype(_tok.vocab_size)), np.array([len(d) for d in docs], np.int64)


def _encoded(batches, workers: int, spec: str):
    """(pos, _encode(batch)) for each (pos, batch) in order, at most 2 batches per worker in flight."""
    if workers == 1:  # in-process: no start-up cost, and callable from a script without a __main__ guard
        _init_worker(spec, False)
        yield from ((pos, _encode(batch)) for pos, batch in batches)
        return
    # spawn, not fork: the parent may hold torch's threads.
    with multiprocessing.get_context("spawn").Pool(workers, _init_worker, (spec, True)) as pool:
        pending = collections.deque()
        while True:
            for pos, batch in itertools.islice(batches, 2 * workers - len(pending)):
                pending.append((pos, pool.apply_async(_encode, (batch,))))
            if not pending:
                return
            pos, result = pending.popleft()
            yield pos, result.get()


def find_inputs(paths: list[str], glob: str | None = None) -> list[str]:
    """Files as given; directories searched (sorted) for `glob`, by default for the formats read."""
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            found = (f for f in p.rglob(glob or "*") if f.is_file() and (glob or KNOWN.search(f.name)))
            files += sorted(map(str, found))
        elif p.is_file():
            files.append(str(p))
        else:
            raise ValueError(f"input {str(p)!r} does not exist")
    if not files:
        raise ValueError(f"no input files in {paths} (name files of other kinds by --glob)")
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
    tok.train_from_iterator((t for _, (parse, *a) in _batches(files, text_field) for t in parse(*a)), trainer)
    tok.save(str(path))


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _commit(tmp: Path, meta: dict, *files) -> None:
    for f in files:
        f.flush()
        os.fsync(f.fileno())
    (tmp / "progress.new").write_text(json.dumps(meta, indent=1))
    os.replace(tmp / "progress.new", tmp / "progress.json")


def prepare(
    files: list[str],
    out_dir: str,
    tokenizer: str = "byte",
    text_field: str = "text",
    workers: int | None = None,
    progress: bool = True,
    train_vocab: int = 0,
) -> dict:
    """Tokenize `files` into a packed dataset at `out_dir` (built in OUT.tmp, renamed when complete;
    run again, it resumes from the last commit, or does nothing once complete); -> its metadata.
    `train_vocab`: with a BPE of that size trained on the files instead of `tokenizer`."""
    out, tmp = Path(out_dir), Path(f"{out_dir}.tmp")
    if train_vocab and train_vocab < 258:
        raise ValueError(f"--train-tokenizer {train_vocab}: 256 bytes, EOS and one merge need 258 or more")
    tok = None if train_vocab else load_tokenizer(tokenizer)  # fails here, before any writing, on a bad spec
    stats = [os.stat(f) for f in files]
    if empty := [f for f, s in zip(files, stats) if not s.st_size]:
        raise ValueError(f"input {empty[0]} is empty: leave it out")
    inputs = [(str(Path(f).resolve()), s.st_size, s.st_mtime_ns) for f, s in zip(files, stats)]
    key = json.dumps([inputs, text_field, train_vocab or tok.hash, BATCH_BYTES])
    key = hashlib.sha256(key.encode()).hexdigest()[:16]  # what a re-run compares
    if out.exists():
        if (meta := _json(out / "meta.json")).get("source") != key:
            raise ValueError(
                f"output {out_dir!r} already exists, from other inputs; remove it or choose another"
            )
        print(f"{out_dir}: already prepared from these inputs; nothing to do", file=sys.stderr)
        return meta
    if resume := _json(tmp / "progress.json").get("source") == key:
        print(f"resuming {tmp} from its last commit", file=sys.stderr)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if train_vocab:
            train_bpe(
                files, text_field, train_vocab, tmp / "tokenizer.json", progress and sys.stderr.isatty()
            )
    tok = load_tokenizer(spec := str(tmp / "tokenizer.json") if train_vocab else tokenizer)
    dtype = _dtype(tok.vocab_size)
    meta = {
        "tokenizer": str(out.resolve() / "tokenizer.json") if train_vocab else tok.name,
        "tokenizer_hash": tok.hash,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "dtype": np.dtype(dtype).name,
        "num_files": len(files),
        "source": key,
        "batches": 0,
        "num_tokens": 0,
        "num_docs": 0,
        "max_token_id": 0,
        **(_json(tmp / "progress.json") if resume else {}),
    }
    total = sum(s.st_size for s in stats)
    workers = min(workers or os.cpu_count() or 1, -(-total // BATCH_BYTES))  # no more than the batches
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc="tokenizing",
        disable=not (progress and sys.stderr.isatty()),
    )
    start, new = time.monotonic(), 0
    with open(tmp / "tokens.bin", "ab") as tf, open(tmp / "doc_ends.bin", "ab") as ef:
        tf.truncate(meta["num_tokens"] * np.dtype(dtype).itemsize)  # back to the last commit
        ef.truncate(meta["num_docs"] * 8)
        _commit(tmp, meta)
        batches = itertools.islice(_batches(files, text_field), meta["batches"], None)
        for pos, (tokens, lengths) in _encoded(batches, workers, spec):
            tf.write(tokens.data)
            ef.write((meta["num_tokens"] + np.cumsum(lengths)).data)
            meta["batches"] += 1
            meta["num_tokens"] += len(tokens)
            meta["num_docs"] += len(lengths)
            meta["max_token_id"] = max(meta["max_token_id"], int(tokens.max(initial=0)))
            if meta["batches"] % COMMIT_BATCHES == 0:
                _commit(tmp, meta, tf, ef)
            new += len(tokens)
            rate = new / (time.monotonic() - start)
            bar.set_postfix_str(
                f"{meta['num_docs']:,} docs, {meta['num_tokens']:,} tokens, {rate:,.0f} tokens/s"
            )
            bar.update(pos - bar.n)
        _commit(tmp, meta, tf, ef)
    bar.close()
    if meta["num_tokens"] == meta["num_docs"]:
        shutil.rmtree(tmp)
        raise ValueError(f"the inputs hold no text ({meta['num_docs']} documents, all empty)")
    os.replace(tmp / "progress.json", tmp / "meta.json")
    tmp.rename(out)
    return meta


def stdlib_corpus() -> list[str]:
    """The built-in corpus: this Python's top-level standard-library .py files (~4.7 MB on 3.11), sorted."""
    return sorted(str(p) for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
