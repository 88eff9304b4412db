import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pith_train.config import BLEND_BLOCK
from pith_train.data import Blend, PackedDataset, WindowLoader
from pith_train.prepare import ByteTokenizer, find_inputs, load_tokenizer, prepare, stdlib_corpus
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

DOCS = ["héllo wörld\n", "second document, with more words than the first", "x"]
ROWS = ["a jsonl row", "another \u2603 row", "third"]


def _inputs(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i, text in enumerate(DOCS):
        (src / f"{i}.txt").write_text(text)
    (src / "rows.jsonl").write_text(
        "\n".join(json.dumps({"body": t, "id": i}) for i, t in enumerate(ROWS)) + "\n"
    )
    return src


def _bpe(tmp_path) -> str:
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "[UNK]"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(DOCS + ROWS, trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def _documents(ds: PackedDataset) -> list[np.ndarray]:
    starts = np.concatenate([[0], ds.doc_ends[:-1]])
    return [np.asarray(ds.tokens[s:e]) for s, e in zip(starts, ds.doc_ends)]


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_prepare_round_trips_txt_and_jsonl_documents(tmp_path, kind):
    spec = "byte" if kind == "byte" else _bpe(tmp_path)
    files = find_inputs([str(_inputs(tmp_path))])
    meta = prepare(files, str(tmp_path / "ds"), spec, text_field="body", workers=2, progress=False)
    ds = PackedDataset(str(tmp_path / "ds"))
    tok = load_tokenizer(spec)
    texts = DOCS + ROWS  # find_inputs sorts: 0.txt 1.txt 2.txt rows.jsonl
    assert meta["num_docs"] == len(texts) == len(ds.doc_ends)
    assert meta["num_tokens"] == len(ds.tokens) == ds.doc_ends[-1]
    assert meta["vocab_size"] == tok.vocab_size and meta["tokenizer_hash"] == tok.hash
    assert ds.tokens.dtype == np.uint16
    for text, doc in zip(texts, _documents(ds)):
        assert doc[-1] == tok.eos_id
        if kind == "byte":
            assert bytes(doc[:-1].astype(np.uint8)).decode() == text
        else:
            assert tok.tok.decode(doc[:-1].tolist()) == text


def test_prepare_rejects_bad_inputs_before_writing(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        find_inputs([str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="expected 'byte' or a tokenizer.json"):
        prepare([str(_inputs(tmp_path) / "0.txt")], str(tmp_path / "ds"), "nope.json", progress=False)
    (tmp_path / "raw.json").write_text("not json")
    with pytest.raises(ValueError, match="raw.json: not a tokenizer.json"):
        prepare(
            [str(tmp_path / "src" / "0.txt")],
            str(tmp_path / "ds"),
            str(tmp_path / "raw.json"),
            progress=False,
        )
    with pytest.raises(ValueError, match="--train-tokenizer 0: 256 bytes, EOS and one merge need 258"):
        prepare([str(tmp_path / "src" / "0.txt")], str(tmp_path / "ds"), progress=False, train_vocab=0)
    assert not (tmp_path / "ds").exists()
    (tmp_path / "bad.jsonl").write_text('{"text": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: expected a JSON object with a string field 'text'"):
        prepare([str(tmp_path / "bad.jsonl")], str(tmp_path / "ds2"), "byte", workers=1, progress=False)
    assert not (tmp_path / "ds2").exists()
    (tmp_path / "broken.jsonl").write_text('{"text": "fine"}\n{"text": "cut\n')
    with pytest.raises(ValueError, match="broken.jsonl:2: not valid JSON"):
        prepare([str(tmp_path / "broken.jsonl")], str(tmp_path / "ds3"), "byte", workers=1, progress=False)


def test_a_truncated_or_missing_document_ends_file_is_named_with_the_fix(tmp_path, byte_data):
    """A cut doc_ends.bin trained on: every token after its last end was one document (positions and
    labels across documents under data.document_mask); a missing one was a bare errno."""
    import shutil

    shutil.copytree(byte_data, tmp_path / "ds")
    ends = tmp_path / "ds" / "doc_ends.bin"
    ends.write_bytes(ends.read_bytes()[:-8])
    for _ in range(2):
        with pytest.raises(ValueError, match=r"doc_ends.bin is missing or cut; prepare the dataset again"):
            PackedDataset(str(tmp_path / "ds"))
        ends.unlink(missing_ok=True)


def test_a_truncated_tokens_file_is_named_with_the_fix(tmp_path, byte_data):
    import shutil

    shutil.copytree(byte_data, tmp_path / "ds")
    tokens = tmp_path / "ds" / "tokens.bin"
    size = tokens.stat().st_size
    tokens.write_bytes(tokens.read_bytes()[: size // 2])
    with pytest.raises(
        ValueError, match=f"tokens.bin: {size // 2} bytes, but meta.json says {size // 2} tokens"
    ):
        PackedDataset(str(tmp_path / "ds"))
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
    for text in ["{", "[1, 2]", json.dumps({k: v for k, v in meta.items() if k != "tokenizer_hash"})]:
        (tmp_path / "ds" / "meta.json").write_text(text)
        with pytest.raises(ValueError, match="meta.json: not a prepare-data meta.json"):
            PackedDataset(str(tmp_path / "ds"))


@pytest.fixture(scope="module")
def val_data(tmp_path_factory):
    """Another byte dataset (a fourth standard-library file), for data.val_path."""
    out = tmp_path_factory.mktemp("val") / "bytes"
    prepare(stdlib_corpus()[3:4], str(out), "byte", progress=False, workers=1)
    return out


def _cut(ds: PackedDataset, seq_len: int, i: int) -> tuple:
    """Window i's inputs, straight from the packed tokens."""
    return tuple(ds.tokens[i * seq_len : (i + 1) * seq_len].astype(np.int64).tolist())


@settings(max_examples=30)
@given(
    val_windows=st.integers(1, 11),
    micro_batch=st.integers(1, 4),
    ranks=st.integers(1, 5),
    separate=st.booleans(),
)
def test_validation_covers_every_window_once_whatever_the_layout(
    byte_data, val_data, val_windows, micro_batch, ranks, separate
):
    """Formerly the remainder of val_windows / ranks was dropped (a layout-dependent validation loss,
    NaN with fewer windows than ranks); then the padding rows' ignored labels were written into their
    inputs too (an embedding IndexError in validation). Validated windows: one from each of
    val_windows equal parts of the validation dataset (data.val_path's when `separate`)."""
    ds, val_ds = PackedDataset(str(byte_data)), PackedDataset(str(val_data))
    loader = WindowLoader(ds, 16, val_windows, seed=0, val_ds=val_ds if separate else None)
    shares = [list(loader.val_batches(micro_batch, r, ranks)) for r in range(ranks)]
    assert len({len(s) for s in shares}) == 1  # every rank runs the same number of batches
    counted = []
    for share in shares:
        for inputs_BS, labels_BS in share:
            assert inputs_BS.shape == labels_BS.shape == (micro_batch, 16)
            assert (inputs_BS >= 0).all()  # padding rows' labels once overwrote their inputs (a view)
            kept = (labels_BS != -100).all(1)
            assert ((labels_BS == -100).all(1) | kept).all()  # a row counts whole or not at all
            counted += [tuple(row.tolist()) for row in inputs_BS[kept]]
    source = val_ds if separate else ds
    total = source.num_windows(16)
    ids = sorted(loader.val_ids.tolist())
    assert all(k * total <= i * val_windows < (k + 1) * total for k, i in enumerate(ids))  # one per part
    assert sorted(counted) == sorted(_cut(source, 16, i) for i in ids)


@pytest.mark.parametrize("separate", [False, True])
def test_an_epoch_trains_every_window_but_the_held_out_ones(byte_data, val_data, separate):
    """Validation windows are held out of training, spread over the corpus (not its tail, which may be
    one document) whatever the seed; with data.val_path nothing is held out. Each epoch trains every
    other window once."""
    ds, val_ds = PackedDataset(str(byte_data)), PackedDataset(str(val_data)) if separate else None
    loaders = [WindowLoader(ds, 16, 8, seed, val_ds) for seed in (5, 6)]
    held = set(loaders[0].val_ids.tolist()) if not separate else set()
    assert np.array_equal(loaders[0].val_ids, loaders[1].val_ids)  # the seed does not choose them
    total = ds.num_windows(16)
    if not separate:
        assert len(held) == 8 and min(held) < total // 8 and max(held) >= total * 7 // 8
    expected = sorted(_cut(ds, 16, i) for i in range(total) if i not in held)
    for loader in loaders:
        for epoch in range(2):
            first = epoch * loader.num_train
            seen = [loader.step_batch(c, 1, 1)[0][0][0] for c in range(first, first + loader.num_train)]
            assert sorted(tuple(x.tolist()) for x in seen) == expected


def test_dataset_checks_tokenizer_and_vocab(tmp_path, byte_data):
    ds = PackedDataset(str(byte_data))
    ds.check_tokenizer(ByteTokenizer())
    with pytest.raises(ValueError, match="made with tokenizer byte"):
        ds.check_tokenizer(load_tokenizer(_bpe(tmp_path)))
    with pytest.raises(
        ValueError, match="vocab size 257 .* more than the model's 128: train with --model.vocab_size=320 "
    ):
        ds.check_vocab(128)
    with pytest.raises(ValueError, match="no prepared dataset"):
        PackedDataset(str(tmp_path))


def test_loader_is_deterministic_sharded_and_resumable(byte_data):
    ds = PackedDataset(str(byte_data))
    loader = WindowLoader(ds, seq_len=16, val_windows=8, seed=5)
    # Windows: labels are inputs shifted by one, cut from the packed tokens.
    x, y = loader.step_batch(0, 8, 8)[0]
    assert x.shape == (8, 16) and torch.equal(x[:, 1:], y[:, :-1])
    # A fresh loader at the same cursor gives the same step (exact resume), another seed another one.
    steps = [loader.step_batch(c, 8, 2) for c in (0, 8, 16)]
    again = WindowLoader(ds, 16, 8, seed=5).step_batch(16, 8, 2)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(steps[2], again))
    other = WindowLoader(ds, 16, 8, seed=6).step_batch(0, 8, 2)
    assert not torch.equal(other[0][0], steps[0][0][0])
    # Micro-batch j holds the same sequences whatever the layout: R ranks x m sequences each, in rank order.
    whole = loader.step_batch(8, 8, 4)  # one rank, micro-batches of 4
    ranks = [loader.step_batch(8, 8, 2, rank=r, ranks=2) for r in range(2)]
    for j in range(2):
        assert torch.equal(torch.cat([ranks[0][j][0], ranks[1][j][0]]), whole[j][0])


def test_loader_rejects_too_little_data(byte_data, val_data):
    ds = PackedDataset(str(byte_data))
    with pytest.raises(
        ValueError,
        match=r"has 2 windows of data.seq_len=4096, fewer than 17 \(16 held out \(data.val_windows\) and one",
    ):
        WindowLoader(ds, seq_len=4096, val_windows=16, seed=0)
    with pytest.raises(
        ValueError,
        match=r"bytes has 0 windows of data.seq_len=4096, fewer than 2 \(data.val_windows\): lower data.val_",
    ):
        WindowLoader(ds, seq_len=4096, val_windows=2, seed=0, val_ds=PackedDataset(str(val_data)))


class _Source:
    """A WindowLoader's part a Blend reads: `_train_id` (here the identity on a source of `num_train`
    windows), tokens and S."""

    def __init__(self, num_train: int):
        self.num_train, self.S, self.tokens = num_train, 1, np.zeros(1)

    def _train_id(self, k: int) -> int:
        return k


@settings(max_examples=40, deadline=None)
@given(
    weights=st.lists(st.floats(0.01, 100), min_size=1, max_size=4),
    first=st.integers(0, 3 * BLEND_BLOCK),
    n=st.integers(1, 4000),
    seed=st.integers(0, 2**31),
)
def test_a_blend_takes_each_source_at_its_weight_within_binomial_noise(weights, first, n, seed):
    """The samples [first, first + n) hold each source within 5 sigma of n * its weight (a block's mix is
    exact; within one it is drawn without replacement, closer than binomial); each source's samples are
    its own order's next ones, counted by taken() from any position alone (a pure function of k)."""
    blend = Blend([_Source(7) for _ in weights], weights, seed)
    counts, share = blend.counts, np.asarray(weights) / sum(weights)
    assert counts.sum() == BLEND_BLOCK and (np.abs(counts - share * BLEND_BLOCK) < 1).all()
    picks = [blend.source(k) for k in range(first, first + n)]
    got = np.bincount([d for d, _ in picks], minlength=len(weights))
    assert (np.abs(got - n * share) <= 5 * np.sqrt(n * share * (1 - share)) + 1).all(), (got, n * share)
    before = Blend([_Source(7) for _ in weights], weights, seed).taken(first)
    assert (np.asarray(before) + got).tolist() == Blend(blend.loaders, weights, seed).taken(first + n)
    for d in range(len(weights)):  # a source's samples are its next ones, in order
        assert [i for s, i in picks if s == d] == list(range(before[d], before[d] + got[d]))


def test_a_blend_of_one_source_is_its_loaders_order_and_a_blend_any_layouts(byte_data, val_data):
    ds, val_ds = PackedDataset(str(byte_data)), PackedDataset(str(val_data))
    alone = WindowLoader(ds, 16, 4, seed=5)
    blend = Blend([WindowLoader(ds, 16, 4, seed=5)], [], seed=5)
    for cursor in (0, 8, BLEND_BLOCK - 4):
        for a, b in zip(alone.step_batch(cursor, 8, 4), blend.step_batch(cursor, 8, 4)):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    two = Blend([WindowLoader(ds, 16, 4, 5), WindowLoader(val_ds, 16, 4, 5)], [0.75, 0.25], seed=5)
    whole = two.step_batch(BLEND_BLOCK - 8, 16, 4)  # across a block's end
    ranks = [two.step_batch(BLEND_BLOCK - 8, 16, 2, rank=r, ranks=2) for r in range(2)]
    fresh = Blend([WindowLoader(ds, 16, 4, 5), WindowLoader(val_ds, 16, 4, 5)], [3, 1], seed=5)
    for j in range(2):
        assert torch.equal(torch.cat([ranks[0][j][0], ranks[1][j][0]]), whole[j][0])
        assert torch.equal(fresh.step_batch(BLEND_BLOCK - 8, 16, 4)[j][0], whole[j][0])  # resumed there
    rows = {tuple(r.tolist()) for x, _ in two.step_batch(0, 64, 64) for r in x}
    sources = [{_cut(d, 16, i) for i in range(d.num_windows(16))} for d in (ds, val_ds)]
    assert all(r in sources[0] or r in sources[1] for r in rows) and all(rows & s for s in sources)
