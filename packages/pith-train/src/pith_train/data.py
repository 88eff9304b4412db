"""The packed dataset and its windows of seq_len + 1 tokens at stride seq_len, in the order of the
pith-train README's Data layout.

Shape legend: B sequences, S sequence length.
"""

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from pith_train.config import BLEND_BLOCK
from pith_train.prepare import ByteTokenizer, HFTokenizer, padded_vocab


class PackedDataset:
    def __init__(self, path: str, key: str = "data.path"):
        meta_path = Path(path) / "meta.json"
        if not meta_path.is_file():
            raise ValueError(f"{key} {path!r}: no prepared dataset there (run `pith-train prepare-data`)")
        self.path = path
        try:
            self.meta = json.loads(meta_path.read_text())
            if lost := {"tokenizer", "tokenizer_hash", "vocab_size", "eos_id"} - self.meta.keys():
                raise KeyError(sorted(lost))
            n, dtype = self.meta["num_tokens"], np.dtype(self.meta["dtype"])
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(
                f"{meta_path}: not a prepare-data meta.json ({e!r}); prepare the dataset again"
            ) from None
        tokens_bin = Path(path) / "tokens.bin"
        size = tokens_bin.stat().st_size if tokens_bin.is_file() else None
        if size != n * dtype.itemsize:
            raise ValueError(
                f"{tokens_bin}: {'missing' if size is None else f'{size} bytes'}, but meta.json says"
                f" {n} tokens of {dtype.name} ({n * dtype.itemsize} bytes): incomplete or another dataset's:"
                f" remove {path} and run `pith-train prepare-data` again"
            )
        self.tokens = np.memmap(tokens_bin, dtype=dtype, mode="r", shape=(n,))
        mask = Path(path) / "loss_mask.bin"  # prepare-data --chat's: 1 where a token's loss counts
        self.loss_mask = np.memmap(mask, np.uint8, "r") if mask.is_file() else None
        chat = "assistant_tokens" in self.meta
        if chat != mask.is_file() or chat and len(self.loss_mask) != n:
            raise ValueError(f"{mask} is missing or not one byte per token; prepare the dataset again")
        ends = Path(path) / "doc_ends.bin"
        self.doc_ends = np.fromfile(ends, np.int64) if ends.is_file() else np.empty(0)
        if self.doc_ends[-1:].tolist() != [n]:
            raise ValueError(f"{ends} is missing or cut; prepare the dataset again")

    def fingerprint(self) -> str:
        """Sizes and 64 evenly spaced slices of tokens, document ends, loss mask (whole: minutes)."""
        h = hashlib.sha256()
        for a in filter(lambda a: a is not None, (self.tokens, self.doc_ends, self.loss_mask)):
            h.update(b"%d" % len(a) + b"".join(a[i * len(a) // 64 :][:64].tobytes() for i in range(64)))
        return h.hexdigest()[:16]

    def check_tokenizer(self, tok: ByteTokenizer | HFTokenizer) -> None:
        m = self.meta
        if m["tokenizer_hash"] != tok.hash:
            raise ValueError(
                f"dataset {self.path} was made with tokenizer {m['tokenizer']} (hash {m['tokenizer_hash']}),"
                f" but data.tokenizer is {tok.name} (hash {tok.hash}): use the tokenizer it was made with, or"
                " prepare it with this one"
            )

    def check_vocab(self, model_vocab: int) -> None:
        """The vocabulary and the largest id (meta.json's, else read: ~1 s/GB) within the model's."""
        vocab, top = self.meta["vocab_size"], self.meta.get("max_token_id")
        if vocab > model_vocab:
            what = f"vocab size {vocab} (tokenizer {self.meta['tokenizer']})"
        elif (top := top if top is not None else max_id(self.tokens)) >= model_vocab:
            what, vocab = f"holds token id {top}", top + 1
        else:
            return
        raise ValueError(
            f"dataset {self.path} {what}, more than the model's {model_vocab}: train with"
            f" --model.vocab_size={padded_vocab(vocab)} (rounded up to a multiple of 64)"
        )

    def num_windows(self, seq_len: int) -> int:
        return (len(self.tokens) - 1) // seq_len


def max_id(tokens: np.ndarray, chunk: int = 1 << 26) -> int:
    return max((int(tokens[i : i + chunk].max()) for i in range(0, len(tokens), chunk)), default=-1)


def windows(tokens: np.ndarray, seq_len: int, ids: np.ndarray, doc_ends=None, loss_mask=None):
    """-> (inputs, labels); a label -100 (ignored) where loss_mask (prepare-data --chat's) is 0; with
    doc_ends (data.document_mask) also where a document starts, and positions from each document's (or
    the window's) start."""
    rows = np.stack([tokens[i * seq_len : (i + 1) * seq_len + 1] for i in ids]).astype(np.int64)
    # Two tensors, not two views of one: a caller writing labels (val_batches' padding) leaves inputs.
    out = torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(rows[:, 1:].copy())
    if loss_mask is not None:
        masks = np.stack([loss_mask[i * seq_len + 1 : (i + 1) * seq_len + 1] for i in ids])
        out[1][torch.from_numpy(masks == 0)] = -100
    if doc_ends is None:
        return out
    first_BS = ids[:, None] * seq_len
    g_BS = first_BS + np.arange(seq_len + 1)  # token indices in the corpus
    k_BS = np.searchsorted(doc_ends, g_BS, side="right")
    start_BS = np.where(k_BS > 0, doc_ends[k_BS - 1], 0)  # each token's document's first token
    out[1][torch.from_numpy(start_BS[:, 1:] == g_BS[:, 1:])] = -100
    return *out, torch.from_numpy(g_BS[:, :-1] - np.maximum(start_BS[:, :-1], first_BS))


class WindowLoader:
    """Windows of a PackedDataset (validation ones of `val_ds` when given); a step's depend only on
    (seed, cursor)."""

    def __init__(self, ds: PackedDataset, seq_len: int, val_windows: int, seed: int, val_ds=None, docs=False):
        self.tokens, self.mask, self.S, self.seed = ds.tokens, ds.loss_mask, seq_len, seed
        val_from = val_ds or ds
        self.doc_ends, self.val_doc_ends = (ds.doc_ends, val_from.doc_ends) if docs else (None, None)
        total, val_total = ds.num_windows(seq_len), val_from.num_windows(seq_len)
        held = 0 if val_ds else val_windows
        train_needs = f"{held} held out (data.val_windows) and one to train"
        for d, n, need, what in ((ds, total, held + 1, train_needs), (val_from, val_total, val_windows, "")):
            if n < need:
                raise ValueError(
                    f"dataset {d.path} has {n} windows of data.seq_len={seq_len}, fewer than {need}"
                    f" ({what or 'data.val_windows'}): lower data.val_windows or data.seq_len"
                )
        self.val_tokens, self.val_mask = val_from.tokens, val_from.loss_mask
        # the middle window of each of val_windows parts (a corpus's tail is often one document)
        self.val_ids = (2 * np.arange(val_windows) + 1) * val_total // (2 * val_windows)
        m = self.val_mask  # as tokens too: a label >= 0 counts
        if m is not None and (windows(m, seq_len, self.val_ids, self.val_doc_ends, m)[1] < 0).all():
            why = "hold no assistant token (val_loss 0/0): change data.val_windows"
            raise ValueError(f"the {val_windows} validation windows of {val_from.path} {why}")
        self.train_ids = np.setdiff1d(np.arange(total), self.val_ids) if held else np.arange(total)
        self.num_train = len(self.train_ids)
        self._epoch, self._order = -1, None

    def _train_id(self, k: int) -> int:
        epoch, i = divmod(k, self.num_train)
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch, self._order = epoch, rng.permutation(self.num_train)
        return int(self.train_ids[self._order[i]])

    def _rows(self, ks: range) -> tuple[torch.Tensor, ...]:
        ids = np.array([self._train_id(k) for k in ks])
        return windows(self.tokens, self.S, ids, self.doc_ends, self.mask)

    def step_batch(
        self, cursor: int, global_batch: int, micro_batch: int, rank: int = 0, ranks: int = 1
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        firsts = [
            cursor + (j * ranks + rank) * micro_batch for j in range(global_batch // (micro_batch * ranks))
        ]
        return [self._rows(range(first, first + micro_batch)) for first in firsts]

    def val_batches(self, micro_batch: int, rank: int = 0, ranks: int = 1, ignore_index: int = -100):
        """This rank's share of the validation windows, sliced as step_batch slices a step; rows past
        the last repeat it with labels `ignore_index`: every rank runs as many batches."""
        n, per_round = len(self.val_ids), micro_batch * ranks
        for first in range(0, n, per_round):
            ids = np.arange(first + rank * micro_batch, first + (rank + 1) * micro_batch)
            val_ids = self.val_ids[np.minimum(ids, n - 1)]
            batch = windows(self.val_tokens, self.S, val_ids, self.val_doc_ends, self.val_mask)
            batch[1][torch.from_numpy(ids >= n)] = ignore_index
            yield batch


def blend_counts(weights: list[float]) -> np.ndarray:
    """Each source's samples in a block of BLEND_BLOCK: its share of the weights, largest remainder."""
    share = np.asarray(weights or [1.0]) / sum(weights or [1.0]) * BLEND_BLOCK
    n = np.floor(share).astype(np.int64)
    n[np.argsort(n - share, kind="stable")[: BLEND_BLOCK - n.sum()]] += 1
    return n


class Blend:
    """WindowLoaders mixed by weight (pith-train README, Blends): sample k is a pure function of (seed,
    weights, sizes, k); O(1) host work a sample, O(BLEND_BLOCK) a block, whatever the corpus size."""

    step_batch = WindowLoader.step_batch

    def __init__(self, loaders: list[WindowLoader], weights: list[float], seed: int):
        self.loaders, self.counts, self.seed, self._block = loaders, blend_counts(weights), seed, -1

    def _at(self, k: int) -> int:
        b, i = divmod(k, BLEND_BLOCK)
        if b != self._block:
            n = self.counts
            src = np.random.default_rng([self.seed, b, 0xB1E4D]).permutation(np.repeat(np.arange(len(n)), n))
            rank = np.empty_like(src)  # the sample's index among its source's in the block
            rank[np.argsort(src, kind="stable")] = np.arange(BLEND_BLOCK) - np.repeat(np.cumsum(n) - n, n)
            self._block, self._src, self._rank = b, src, rank
        return i

    def taken(self, cursor: int) -> np.ndarray:
        """Samples of each source among the first `cursor`."""
        i = self._at(cursor)
        n = self.counts
        return (n * (cursor // BLEND_BLOCK) + np.bincount(self._src[:i], minlength=len(n))).tolist()

    def source(self, k: int) -> tuple[int, int]:
        """Sample k's source and its place in that source's order."""
        i = self._at(k)
        d = int(self._src[i])
        return d, int(self.counts[d] * (k // BLEND_BLOCK) + self._rank[i])

    def _rows(self, ks: range) -> tuple[torch.Tensor, ...]:
        at = [(self.loaders[d], n) for d, n in map(self.source, ks)]
        return tuple(map(torch.cat, zip(*(s._rows([n]) for s, n in at))))
