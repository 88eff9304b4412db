"""Tokenizers and `prepare-data` (pith-train README, Commands). No torch import here, so the
tokenizing worker processes start quickly."""

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
import zlib
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

    EOS_NAMES = (
        "<|endoftext|>",
        "</s>",
        "<|end_of_text|>",
        "<eos>",
        "<|eos|>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>",
    )

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.name = str(Path(path).resolve())
        data = Path(path).read_bytes()
        self.hash = hashlib.sha256(data).hexdigest()[:16]
        try:
            self.tok = Tokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # the tokenizers library's, or not UTF-8
            raise ValueError(f"tokenizer {path}: not a tokenizer.json ({e})") from None
        self.vocab_size = max(self.tok.get_vocab(with_added_tokens=True).values()) + 1  # ids may have gaps
        found = [i for t in self.EOS_NAMES if (i := self.tok.token_to_id(t)) is not None]
        if not found:
            raise ValueError(f"tokenizer {path}: has none of the end-of-text tokens {self.EOS_NAMES}")
        self.eos_id = found[0]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encs = self.tok.encode_batch_fast(texts, add_special_tokens=False)  # no offsets
        return [np.array(e.ids, dtype=np.int64) for e in encs]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


def padded_vocab(vocab_size: int) -> int:
    """The model vocabulary to suggest: a multiple of 64, as the GEMMs (and FP8's 16) prefer."""
    return -(-vocab_size // 64) * 64


def tokenizer_file(spec: str) -> str:  # or an HF directory's tokenizer.json
    return str(d) if (d := Path(spec) / "tokenizer.json").is_file() else spec


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    if spec == "byte":
        return ByteTokenizer()
    if not Path(spec := tokenizer_file(spec)).is_file():
        raise ValueError(f"tokenizer: expected 'byte' or a tokenizer.json (or its directory), got {spec!r}")
    return HFTokenizer(spec)


# The parent reads batches of ~BATCH_BYTES of text (`_batches`), workers tokenize them (`_encode`), the
# parent writes them in order: 2 batches per worker in flight, and the largest document.
BATCH_BYTES = 1 << 20
DATA_BINS = {"tokens.bin", "doc_ends.bin", "loss_mask.bin"}
KNOWN = re.compile(r"\.(txt|jsonl?)(\.gz|\.zst)?$|\.parquet$")


def jsonl_rows(lines, path: str, first: int = 1):
    """(line number from `first`, value) of each non-blank JSON line of `path`."""
    for n, line in enumerate(lines, first):
        if line.strip():
            try:
                yield n, json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e}); fix or remove that line") from None


def _jsonl_texts(block: bytes, where: tuple[str, int], field: str) -> list[str]:
    """The `field` strings of a block of JSONL lines; `where`: its file and first line number."""
    texts = []
    for n, row in jsonl_rows(block.split(b"\n"), *where):
        if not isinstance(row, dict) or not isinstance(row.get(field), str):
            raise ValueError(f"{where[0]}:{n}: expected a JSON object with a string field {field!r}")
        texts.append(row[field])
    return texts


def _file_batches(path: str, field: str):
    """(bytes of `path` read, (parse, *args)) for each batch of its texts. A file other than .json(l)
    or .parquet is one text."""
    size = os.path.getsize(path)
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        def read(f, *args):  # arrow's errors name no file
            try:
                return f(*args)
            except (ValueError, OSError) as e:
                raise ValueError(f"{path}: not a whole Parquet file ({e})") from None

        table, done = read(pq.ParquetFile, path), 0
        if field not in table.schema_arrow.names:
            raise ValueError(f"{path}: no column {field!r} (it has {table.schema_arrow.names})")
        batches = table.iter_batches(1024, columns=[field])
        while (records := read(next, batches, None)) is not None:
            texts = records.column(0).to_pylist()
            if not all(isinstance(t, str) for t in texts):
                raise ValueError(f"{path}: column {field!r} holds {set(map(type, texts))}, not strings")
            done += len(texts)
            yield size * done // table.metadata.num_rows, (list, texts)
        return
    with open(path, "rb") as raw:
        chunks = filter(None, decompress(path, raw))
        if not re.search(r"\.jsonl?(\.gz|\.zst)?$", path):
            yield size, (list, [b"".join(chunks).decode("utf-8", errors="replace")])
            return
        line, rest = 1, bytearray()
        while True:
            chunk = next(chunks, b"")
            rest += chunk  # cut at the last line's end, which only the new chunk can hold
            if cut := rest.rfind(b"\n", len(rest) - len(chunk)) + 1 if chunk else len(rest):
                block = bytes(rest[:cut])
                del rest[:cut]
                yield raw.tell(), (_jsonl_texts, block, (path, line), field)
                line += block.count(b"\n")
            if not chunk:
                return


def decompress(path: str, raw):
    """`path`'s bytes in chunks, decompressed (.zst: each frame, the last checked whole)."""
    bad = zlib.error
    if path.endswith(".zst"):  # only then: some installs lack it
        import zstandard

        bad = zstandard.ZstdError
    try:
        if not path.endswith(".zst"):
            f = gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw
            yield from iter(lambda: f.read(BATCH_BYTES), b"")
            return
        frame = None  # between frames
        while data := raw.read(1 << 16):
            while data:
                frame = frame or zstandard.ZstdDecompressor().decompressobj()
                yield frame.decompress(data)
                data, frame = (frame.unused_data, None) if frame.eof else (b"", frame)
        if frame:
            raise EOFError("the last frame is cut")
    except (EOFError, gzip.BadGzipFile, zlib.error, bad) as e:
        raise ValueError(f"{path}: truncated or corrupt compressed data ({e})") from None


def _batches(files: list[str], field: str):
    """(input bytes read, batch) over `files`: the same batches whatever the workers."""
    done = 0
    for path in files:
        yield from ((done + pos, batch) for pos, batch in _file_batches(path, field))
        done += os.path.getsize(path)


_tok = None


def _init_worker(spec: str, pool: bool) -> None:
    global _tok  # one tokenizer per worker, built once, on one thread
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if pool:  # Ctrl-C reaches the whole process group: the parent stops the pool
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    _tok = load_tokenizer(spec)
    if isinstance(_tok, HFTokenizer):  # "<|endoftext|>" in a document is text (as tiktoken's default)
        _tok.tok.encode_special_tokens = True


def _encode(batch: tuple) -> tuple[np.ndarray, np.ndarray]:
    """-> (the batch's documents' tokens, each followed by EOS, in the dataset's dtype; their lengths)."""
    parse, *args = batch
    docs = [np.append(ids, _tok.eos_id) for ids in _tok.encode_batch(parse(*args))]
    tokens = np.concatenate(docs) if docs else np.zeros(0, np.int64)
    dtype = np.uint16 if _tok.vocab_size <= 1 << 16 else np.uint32
    return tokens.astype(dtype), np.array([len(d) for d in docs], np.int64)


def _encoded(batches, workers: int, spec: str):
    """(pos, _encode(batch)) for each (pos, batch), in order; spawned: the parent may hold torch's threads.
    A pool only at 2 batches a worker, counted ahead (compressed bytes do not say)."""
    first = list(itertools.islice(batches, 2 * workers))
    workers, batches = workers * (len(first) == 2 * workers), itertools.chain(first, batches)
    if workers <= 1:  # in-process: no start-up, no __main__ guard needed
        _init_worker(spec, False)
        yield from ((pos, _encode(batch)) for pos, batch in batches)
        return
    with multiprocessing.get_context("spawn").Pool(workers, _init_worker, (spec, True)) as pool:
        pending = []  # at most 2 batches per worker in flight
        while True:
            for pos, batch in itertools.islice(batches, 2 * workers - len(pending)):
                pending.append((pos, pool.apply_async(_encode, (batch,))))
            if not pending:
                return
            pos, result = pending.pop(0)
            yield pos, result.get()


def find_inputs(paths: list[str], glob: str | None = None) -> list[str]:
    """Files as given; directories searched (sorted) for `glob`, by default for the formats read."""
    files = []
    for p in map(Path, paths):
        if not p.exists():
            raise ValueError(f"input {str(p)!r} does not exist")
        found = (f for f in p.rglob(glob or "*") if f.is_file() and (glob or KNOWN.search(f.name)))
        files += sorted(map(str, found)) if p.is_dir() else [str(p)]
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


def clear_leftover(tmp: Path) -> None:
    """Removes `tmp` if it holds only what an interrupted prepare-data leaves; a user's stays."""
    if tmp.exists():
        if not tmp.is_dir() or {p.name for p in tmp.iterdir()} - {"tokenizer.json", "meta.json"} - DATA_BINS:
            raise ValueError(f"{tmp} is in the way and not an interrupted run's: move it")
        print(f"{tmp}: left by an interrupted run; starting again", file=sys.stderr)
        shutil.rmtree(tmp)


def prepare(
    files: list[str], out_dir: str, tokenizer: str = "byte", text_field: str = "text",
    workers: int | None = None, progress: bool = True, train_vocab: int | None = None,
) -> dict:  # fmt: skip
    """`files` -> a packed dataset at `out_dir` (built in OUT.tmp, renamed when complete) -> its meta;
    `train_vocab`: with a BPE of that size trained on the files."""
    out, show = Path(out_dir).resolve(), progress and sys.stderr.isatty()
    tmp = out.with_name(out.name + ".tmp")
    if train_vocab is not None and train_vocab < 258:
        raise ValueError(f"--train-tokenizer {train_vocab}: 256 bytes, EOS and one merge need 258 or more")
    by = train_vocab or load_tokenizer(tokenizer).hash  # fails here, before any writing, on a bad spec
    inputs = [(str(Path(f).resolve()), (s := os.stat(f)).st_size, s.st_mtime_ns) for f in files]
    if empty := [f for f, size, _ in inputs if not size]:
        raise ValueError(f"input {empty[0]} is empty: leave it out")
    key = hashlib.sha256(json.dumps([inputs, text_field, by]).encode()).hexdigest()[:16]
    if out.exists():
        try:
            done = json.loads((out / "meta.json").read_text())
        except (OSError, ValueError):  # none, or not JSON
            done = None
        ours = isinstance(done, dict)  # not: a user's directory, perhaps
        if not ours or done.get("source") != key:
            why = ", from other inputs; remove" if ours else " and is not a prepared dataset: move"
            raise ValueError(f"output {out_dir!r} exists{why} it or choose another")
        print(f"{out_dir}: already prepared from these inputs; nothing to do", file=sys.stderr)
        return done
    clear_leftover(tmp)
    tmp.mkdir(parents=True)
    try:
        if train_vocab:
            train_bpe(files, text_field, train_vocab, tmp / "tokenizer.json", show)
        tok = load_tokenizer(spec := str(tmp / "tokenizer.json") if train_vocab else tokenizer)
        total = sum(size for _, size, _ in inputs)
        workers = workers or os.cpu_count() or 1
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", disable=not show)
        start, docs, n, top = time.monotonic(), 0, 0, 0
        with open(tmp / "tokens.bin", "wb") as tf, open(tmp / "doc_ends.bin", "wb") as ef:
            for pos, (tokens, lengths) in _encoded(_batches(files, text_field), workers, spec):
                tf.write(tokens.data)
                ef.write((n + np.cumsum(lengths)).data)
                n, docs, top = n + len(tokens), docs + len(lengths), max(top, int(tokens.max(initial=0)))
                bar.set_postfix_str(
                    f"{docs:,} docs, {n:,} tokens, {n / (time.monotonic() - start):,.0f} tokens/s", False
                )
                bar.update(pos - bar.n)
        if n == docs:
            raise ValueError(f"the inputs hold no text ({docs} documents, all empty)")
    except ValueError:  # no half-built dataset stays
        shutil.rmtree(tmp)
        raise
    bar.close()
    meta = {
        "tokenizer": str(out / "tokenizer.json") if train_vocab else tok.name, "tokenizer_hash": tok.hash,
        "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "max_token_id": top, "dtype": tokens.dtype.name,
        "num_tokens": n, "num_docs": docs, "num_files": len(files), "source": key,  # what a re-run compares
    }  # fmt: skip
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    tmp.rename(out)
    return meta


def stdlib_corpus() -> list[str]:
    """The built-in corpus: this Python's top-level standard-library .py files (~4.7 MB on 3.11), sorted."""
    return sorted(str(p) for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
