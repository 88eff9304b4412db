"""prepare-data at corpus scale: formats, workers, memory, interruption, refusals."""

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pith_train.prepare as prep
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pith_train.cli import main
from pith_train.data import PackedDataset
from pith_train.prepare import HFTokenizer, find_inputs, prepare, stdlib_corpus


def test_an_empty_input_is_refused_and_any_text_file_is_read_by_glob(tmp_path, capsys):
    """An empty file was prepared (and a BPE trained on nothing); .py files in a folder had to be
    renamed .txt."""
    (tmp_path / "empty.txt").write_text("")
    for extra in ([], ["--train-tokenizer", "300"]):
        with pytest.raises(SystemExit) as e:
            main(["prepare-data", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "ds"), *extra])
        assert e.value.code == 1 and "empty.txt is empty" in capsys.readouterr().err
        assert not (tmp_path / "ds").exists() and not (tmp_path / "ds.tmp").exists()
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "a.py").write_text("print(1)\n")
    (src / "pkg" / "b.py").write_text("x = 2\n")
    (src / "c.txt").write_text("not this one")
    main(["prepare-data", str(src), "--glob", "*.py", "--out", str(tmp_path / "py"), "--workers", "1"])
    ds = PackedDataset(str(tmp_path / "py"))
    assert ds.doc_ends.tolist() == [10, 17]
    assert bytes(ds.tokens[ds.tokens != 256].astype(np.uint8)) == b"print(1)\nx = 2\n"


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_progress_bar_is_drawn_on_a_terminal_only(tmp_path, capsys, monkeypatch):
    """The bar was written into redirected logs."""
    args = ["prepare-data", stdlib_corpus()[0], "--workers", "1", "--out"]
    main([*args, str(tmp_path / "logged")])
    assert "tokenizing" not in capsys.readouterr().err
    monkeypatch.setattr(sys, "stderr", Terminal())
    main([*args, str(tmp_path / "shown")])
    assert "tokens/s" in sys.stderr.getvalue()


DOCS = ["héllo wörld ☃\n", "", 'two\nlines and a "quote"', "x" * 300, "<|endoftext|> as text", "\t tab"]


def _corpus(src):
    """Every format prepare reads (sorted as find_inputs sorts them), with the texts each holds."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    src.mkdir()
    rows = "".join(json.dumps({"text": t, "n": i}) + "\n\n" for i, t in enumerate(DOCS)).encode()
    (src / "a.jsonl").write_bytes(rows[:-2])  # no newline at the end
    (src / "b.jsonl.gz").write_bytes(gzip.compress(rows))
    (src / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(rows))
    (src / "c4-train.00000-of-01024.json.gz").write_bytes(gzip.compress(rows))  # C4's and Dolma's: lines
    pq.write_table(pa.table({"n": range(len(DOCS)), "text": DOCS}), src / "d.parquet", row_group_size=4)
    (src / "e.txt").write_text(DOCS[0] + DOCS[2])
    (src / "f.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(DOCS[3].encode()))
    (src / "g.py").write_text("not found without --glob")
    return DOCS * 5 + [DOCS[0] + DOCS[2], DOCS[3]]


def _bytes(path):
    return [(path / f).read_bytes() for f in ("tokens.bin", "doc_ends.bin", "meta.json")]


def test_every_format_gives_each_documents_own_tokens_whatever_the_workers(tmp_path, monkeypatch):
    """Batches of 64 bytes split every file; 1 or 2 workers write the same dataset, each document
    the tokenizer's tokens for it alone, then EOS."""
    monkeypatch.setattr(prep, "BATCH_BYTES", 64)
    texts = _corpus(tmp_path / "src")
    files = find_inputs([str(tmp_path / "src")])
    assert [Path(f).name[0] for f in files] == list("abccdef")
    spec = str(tmp_path / "tok.json")
    prep.train_bpe(files, "text", 300, Path(spec), progress=False)
    tok = HFTokenizer(spec)
    for workers in (1, 2):
        meta = prepare(files, str(tmp_path / f"w{workers}"), spec, workers=workers, progress=False)
    assert _bytes(tmp_path / "w1") == _bytes(tmp_path / "w2")
    ds = PackedDataset(str(tmp_path / "w2"))
    tok.tok.encode_special_tokens = True  # "<|endoftext|> as text": text
    want = [tok.tok.encode(t, add_special_tokens=False).ids + [tok.eos_id] for t in texts]
    assert (
        np.array_equal(ds.tokens, np.concatenate(want))
        and ds.doc_ends.tolist() == np.cumsum([len(w) for w in want]).tolist()
    )
    assert meta["max_token_id"] == max(map(max, want)) and meta["num_docs"] == len(texts)


@pytest.mark.parametrize(
    "suffix, docs, pool",
    [(".jsonl.gz", 3000, [4]), (".parquet", 9000, [4]), (".jsonl.gz", 40, []), (".jsonl.gz", 10, [])],
)
def test_the_workers_are_as_many_as_the_batches_allow_whatever_the_bytes_on_disk(
    tmp_path, monkeypatch, suffix, docs, pool
):
    """The workers were capped at the inputs' bytes over BATCH_BYTES: a compressed file (or a Parquet
    file's batches of 1,024 records) holds many batches in few bytes, and one worker tokenized them.
    Fewer than 2 batches a worker are tokenized in-process: starting a pool costs more."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(prep, "BATCH_BYTES", 1 << 12)
    texts = [f"document {i % 7} " * 20 for i in range(docs)]  # 3000: ~800 KB of text, 200 batches
    path, lines = tmp_path / f"in{suffix}", "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    if suffix == ".parquet":
        pq.write_table(pa.table({"text": texts}), path)
    else:
        path.write_bytes(gzip.compress(lines))
    assert path.stat().st_size <= 3 * prep.BATCH_BYTES  # what the cap took for the batches

    class Started(Exception):
        pass

    def spawned(n, *args):
        raise Started(n)

    monkeypatch.setattr(
        prep.multiprocessing, "get_context", lambda kind: type("Spawn", (), {"Pool": spawned})
    )
    try:
        prepare([str(path)], str(tmp_path / "out"), workers=4, progress=False)
        started = []
    except Started as e:
        started = list(e.args)
    assert started == pool


@settings(max_examples=40)
@given(
    docs=st.lists(st.text(max_size=20), max_size=12),
    blank=st.lists(st.booleans(), min_size=12, max_size=12),
    batch=st.integers(1, 48),
    end=st.sampled_from(["", "\n", "\n\n"]),
)
def test_jsonl_blocks_cut_at_line_ends_whatever_the_batch(tmp_path_factory, docs, blank, batch, end):
    """Blocks are the file cut at line ends, each with its first line's number; blank lines are no
    documents."""
    lines = [json.dumps({"text": t}) + "\n" * (1 + b) for t, b in zip(docs, blank)]
    path = tmp_path_factory.mktemp("jsonl") / "d.jsonl"
    path.write_bytes(("".join(lines).rstrip("\n") + end).encode())
    old, prep.BATCH_BYTES = prep.BATCH_BYTES, batch
    try:
        batches = [b for _, b in prep._batches([str(path)], "text")]
    finally:
        prep.BATCH_BYTES = old
    blocks = [block for _, block, _, _ in batches]
    assert b"".join(blocks) == path.read_bytes() and all(b.endswith(b"\n") for b in blocks[:-1])
    assert [line for _, _, (_, line), _ in batches] == [
        1 + b"".join(blocks[:i]).count(b"\n") for i in range(len(blocks))
    ]
    assert [t for parse, *args in batches for t in parse(*args)] == docs


def test_formats_refuse_a_missing_field_and_an_existing_output(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a", None]}), tmp_path / "p.parquet")
    with pytest.raises(ValueError, match=r"p.parquet: no column 'text' \(it has \['body'\]\)"):
        prepare([str(tmp_path / "p.parquet")], str(tmp_path / "ds"), progress=False)
    with pytest.raises(ValueError, match="p.parquet: column 'body' holds .*NoneType"):
        prepare([str(tmp_path / "p.parquet")], str(tmp_path / "ds"), text_field="body", progress=False)
    data = (tmp_path / "p.parquet").read_bytes()
    footer, n = bytearray(data), int.from_bytes(data[-8:-4], "little")  # the metadata's length
    footer[-n : -n + 8] = bytes(b ^ 0xFF for b in footer[-n : -n + 8])  # thrift: OSError, not ValueError
    for cut in (data[: len(data) // 2], data[:-9], b"not parquet", footer):  # arrow's error named no file
        (tmp_path / "cut.parquet").write_bytes(cut)
        with pytest.raises(ValueError, match="cut.parquet: not a whole Parquet file"):
            prepare([str(tmp_path / "cut.parquet")], str(tmp_path / "ds"), text_field="body", progress=False)
    # Metadata whole, a data page corrupt: arrow's OSError mid-read named no file either.
    texts = [f"document {i} " * 20 for i in range(5000)]
    pq.write_table(pa.table({"body": texts}), tmp_path / "page.parquet", row_group_size=1000)
    page = bytearray((tmp_path / "page.parquet").read_bytes())
    page[len(page) // 2 : len(page) // 2 + 200] = bytes(b ^ 0x5A for b in page[len(page) // 2 :][:200])
    (tmp_path / "page.parquet").write_bytes(page)
    with pytest.raises(ValueError, match="page.parquet: not a whole Parquet file"):
        prepare([str(tmp_path / "page.parquet")], str(tmp_path / "ds"), text_field="body", progress=False)
    (tmp_path / "blank.jsonl").write_text('\n{"text": ""}\n')
    with pytest.raises(ValueError, match=r"the inputs hold no text \(1 documents, all empty\)"):
        prepare([str(tmp_path / "blank.jsonl")], str(tmp_path / "ds"), progress=False)
    assert not (tmp_path / "ds").exists() and not (tmp_path / "ds.tmp").exists()
    (tmp_path / "a.txt").write_text("a")
    prepare([str(tmp_path / "a.txt")], str(tmp_path / "ds"), progress=False)
    with pytest.raises(ValueError, match="'.*ds' exists, from other inputs; remove it"):
        prepare([str(tmp_path / "a.txt")], str(tmp_path / "ds"), text_field="body", progress=False)
    for damaged in ("garbage", "[1, 2]", None):  # another program's meta.json, a damaged one, none
        meta = tmp_path / "ds" / "meta.json"
        meta.write_text(damaged) if damaged else meta.unlink()
        with pytest.raises(ValueError, match="'.*ds' exists and is not a prepared dataset: move it"):
            prepare([str(tmp_path / "a.txt")], str(tmp_path / "ds"), progress=False)


@pytest.mark.parametrize("name", ["t.txt.gz", "t.jsonl.gz", "t.txt.zst", "t.jsonl.zst", "bad.jsonl.zst"])
def test_a_truncated_or_corrupt_compressed_input_is_refused_naming_the_file(tmp_path, capsys, name):
    """A .zst cut in half was prepared from its first half (exit 0); a cut .gz died with a raw EOFError, a
    corrupt .zst with a raw ZstdError."""
    import gzip

    import zstandard

    text = "".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(3000))
    data = (zstandard.ZstdCompressor().compress if ".zst" in name else gzip.compress)(text.encode())
    whole = tmp_path / name.replace("bad", "t")
    whole.write_bytes(data)  # whole, two frames for zstd: read across them
    if ".zst" in name:
        whole.write_bytes(data + data)
    meta = prepare([str(whole)], str(tmp_path / "whole"), progress=False, workers=1)
    assert meta["num_docs"] == (1 if ".txt" in name else 6000 if ".zst" in name else 3000)
    (tmp_path / name).write_bytes(b"\x00" * 64 + data if name.startswith("bad") else data[: len(data) // 2])
    with pytest.raises(SystemExit) as e:
        main(["prepare-data", str(tmp_path / name), "--out", str(tmp_path / "ds"), "--workers", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and f"{name}: truncated or corrupt" in err and "Traceback" not in err, err
    assert not (tmp_path / "ds").exists() and not (tmp_path / "ds.tmp").exists()


def test_an_output_path_ending_in_a_slash_is_built_beside_it(tmp_path):
    """`--out DIR/` built DIR/.tmp inside DIR, then failed to rename it onto DIR, and refused every retry."""
    (tmp_path / "a.txt").write_text("some text")
    meta = prepare([str(tmp_path / "a.txt")], f"{tmp_path / 'ds'}/", progress=False)
    assert PackedDataset(tmp_path / "ds").meta == meta and sorted(p.name for p in tmp_path.iterdir()) == [
        "a.txt", "ds"
    ]  # fmt: skip


def test_token_ids_past_65535_are_kept_whatever_the_tokenizers_count(tmp_path):
    """A tokenizer with an id gap (4 tokens, the largest id 70000) was stored in uint16: 70000 became 4464."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"a": 0, "b": 1, "<|endoftext|>": 2, "z": 70000}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("a z b")
    meta = prepare(
        [str(tmp_path / "a.txt")], str(tmp_path / "ds"), str(tmp_path / "tokenizer.json"), progress=False
    )
    assert (meta["dtype"], meta["max_token_id"], meta["vocab_size"]) == ("uint32", 70000, 70001)
    assert np.fromfile(tmp_path / "ds" / "tokens.bin", np.uint32).tolist() == [0, 70000, 1, 2]
    again = prepare([str(tmp_path / "a.txt")], str(tmp_path / "ds2"), str(tmp_path), progress=False)
    assert (
        again["tokenizer_hash"] == meta["tokenizer_hash"]
    )  # a Hugging Face directory names its tokenizer.json


def test_a_special_tokens_text_inside_a_document_is_text_not_eos(tmp_path):
    """A literal "<|endoftext|>" in a document became EOS mid-document (100 EOS for 50 documents)."""
    rows = [json.dumps({"text": f"doc {i} says <|endoftext|> and goes on"}) + "\n" for i in range(50)]
    (tmp_path / "d.jsonl").write_text("".join(rows))
    meta = prepare([str(tmp_path / "d.jsonl")], str(tmp_path / "ds"), progress=False, train_vocab=300)
    tokens = np.fromfile(tmp_path / "ds" / "tokens.bin", meta["dtype"])
    ends = np.fromfile(tmp_path / "ds" / "doc_ends.bin", np.int64)
    assert np.flatnonzero(tokens == meta["eos_id"]).tolist() == (ends - 1).tolist()
    tok = HFTokenizer(str(tmp_path / "ds" / "tokenizer.json"))
    assert tok.decode(tokens[: ends[0] - 1].tolist()) == "doc 0 says <|endoftext|> and goes on"


# SIGINT to the whole process group (what Ctrl-C sends) once 8 batches are written.
INTERRUPT = """
import os, signal, sys
import pith_train.prepare as prep
from pith_train.cli import main
prep.BATCH_BYTES, encoded = 1 << 12, prep._encoded
signal.signal(signal.SIGINT, signal.default_int_handler)  # a shell's background job starts ignoring it
def interrupt(*args):
    for i, item in enumerate(encoded(*args)):
        if i == 8:
            os.killpg(0, signal.SIGINT)
        yield item
prep._encoded = interrupt
main(sys.argv[1:])
"""


def test_an_interrupted_run_leaves_no_dataset_and_the_same_command_starts_it_again(tmp_path, capsys):
    """Ctrl-C midway through a 2-worker run of a .jsonl.gz: no dataset pretrain would open; the same
    command starts again and writes what one worker writes; once more, it does nothing."""
    import gzip

    rows = (json.dumps({"text": f"document {i}: " + "abc " * (i % 97)}) + "\n" for i in range(4000))
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress("".join(rows).encode(), 1))
    args = ["prepare-data", str(tmp_path / "c.jsonl.gz"), "--out"]
    out, tmp = tmp_path / "ds", tmp_path / "ds.tmp"
    run = subprocess.run(
        [sys.executable, "-c", INTERRUPT, *args, str(out), "--workers", "2"],
        capture_output=True, text=True, start_new_session=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 130 and "interrupted" in run.stderr, run.stderr
    assert not out.exists() and (tmp / "tokens.bin").stat().st_size > 0
    for path in (out, tmp):
        with pytest.raises(ValueError, match="no prepared dataset there"):
            PackedDataset(str(path))
    main([*args, str(out), "--workers", "2"])
    assert "left by an interrupted run; starting again" in capsys.readouterr().err and not tmp.exists()
    main([*args, str(tmp_path / "one"), "--workers", "1"])
    before = (out / "tokens.bin").stat().st_mtime_ns
    main([*args, str(out)])
    assert "already prepared from these inputs; nothing to do" in capsys.readouterr().err
    assert _bytes(out) == _bytes(tmp_path / "one") and (out / "tokens.bin").stat().st_mtime_ns == before


PEAK = """
import resource, sys
import pith_train.prepare as prep
prep.BATCH_BYTES = 1 << 18
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10  # MiB
before = peak()
prep.prepare([sys.argv[1]], sys.argv[2], workers=2, progress=False)
print(peak() - before)
"""


def test_memory_is_bounded_by_the_batches_in_flight_not_the_corpus(tmp_path):
    """2 workers, batches of 256 KiB: at most 2 per worker in flight (each with its 512 KiB of uint16
    tokens) and the one being written, about 4 MiB; the 24 MiB corpus (48 MiB of tokens) raised the
    parent's peak by 6 MiB, and by 29 MiB when the batches were all handed to the pool at once."""
    line = json.dumps({"text": "abc def " * 125}) + "\n"
    (tmp_path / "c.jsonl").write_text(line * (24 * 2**20 // len(line)))
    run = subprocess.run(
        [sys.executable, "-c", PEAK, str(tmp_path / "c.jsonl"), str(tmp_path / "ds")],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert int(run.stdout) < 16, run.stdout
    assert PackedDataset(str(tmp_path / "ds")).meta["num_tokens"] == 24 * 2**20 // len(line) * 1001


def test_text_and_gzip_inputs_need_no_zstandard(tmp_path, monkeypatch):
    """zstandard is imported for .zst inputs only: an environment without it (the GPU image) prepares
    the built-in corpus, text and .gz."""
    import gzip

    monkeypatch.setitem(sys.modules, "zstandard", None)  # import zstandard raises ImportError
    (tmp_path / "a.txt").write_text("plain text")
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(b'{"text": "zipped"}\n'))
    meta = prepare(
        [str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl.gz")], str(tmp_path / "ds"), progress=False
    )
    assert meta["num_docs"] == 2
    (tmp_path / "c.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    with pytest.raises(ImportError):
        prepare([str(tmp_path / "c.jsonl.zst")], str(tmp_path / "zs"), progress=False)


def test_refusals_name_the_input_and_a_fix_that_works_and_leave_nothing_behind(tmp_path, capsys, monkeypatch):
    """Each gave a message without the file or with a fix that did not work: BPE training on a bad input
    left OUT.tmp; `--out .` said "PosixPath('.') has an
    empty name"; `--chat` without --tokenizer blamed a 'byte' tokenizer nobody gave; a dataset whose
    tokens.bin was cut told the user to prepare it again, which said "already prepared"; options of the
    other kind of input (--max-tokens without --chat, --workers with it) were ignored."""
    (tmp_path / "a.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "c.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    a = str(tmp_path / "a.jsonl")
    cases = [
        ([a, "--out", str(tmp_path / "b"), "--train-tokenizer", "300"], "a.jsonl:1: expected a JSON object"),
        ([a, "--out", "."], "'.' exists and is not a prepared dataset"),
        ([str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "c"), "--chat"], "--chat needs --tokenizer"),
        ([a, "--out", str(tmp_path / "m"), "--max-tokens", "9", "--too-long", "drop"],
         "--max-tokens, --too-long: used only with --chat; omit"),
        ([str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "c"), "--chat", "--workers", "2"],
         "--workers: not used with --chat; omit"),
    ]  # fmt: skip
    monkeypatch.chdir(tmp_path)
    for args, why in cases:
        with pytest.raises(SystemExit):
            main(["prepare-data", *args])
        assert why in capsys.readouterr().err, args
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "c.jsonl"]
    (tmp_path / "t.txt").write_text("some text")
    prepare([str(tmp_path / "t.txt")], str(tmp_path / "ds"), progress=False)
    with open(tmp_path / "ds" / "tokens.bin", "r+b") as f:
        f.truncate(3)
    with pytest.raises(ValueError, match="incomplete or another dataset's: remove .*ds and run"):
        PackedDataset(str(tmp_path / "ds"))


def test_a_deepseek_tokenizer_ends_documents_with_its_end_of_sentence_token(tmp_path):
    """DeepSeek's tokenizers have none of the other families' end-of-text tokens: every command that
    reads one refused it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(
        models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}, merges=[])
    )
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.add_special_tokens(
        ["<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>"]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("one document")
    prepare([str(tmp_path / "a.txt")], str(tmp_path / "d"), str(tmp_path / "tokenizer.json"), progress=False)
    ds = PackedDataset(str(tmp_path / "d"))
    assert ds.meta["eos_id"] == 257 and ds.tokens[-1] == 257 and len(ds.tokens) == len("one document") + 1
