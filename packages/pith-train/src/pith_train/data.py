"""The packed dataset and its windows of seq_len + 1 tokens at stride seq_len, in the order the
pith-train README (Data layout) sets out and the parallel engine relies on.

Shape legend: B sequences, S sequence length.
"""

import json
from pathlib import Path

import numpy as np
import torch

from pith_train.prepare import ByteTokenizer, HFTokenizer, padded_vocab


class PackedDataset:
    def __init__(self, path: str, key: str = "data.path"):
        meta_path = Path(path) / "meta.json"
        if not meta_path.is_file():
            raise ValueError(f"{key} {path!r}: no prepared dataset there (run `pith-train prepare-data`)")
        self.path = path
        try:
            self.meta = json.loads(meta_path.read_text())
            n, dtype = self.meta["num_tokens"], np.dtype(self.meta["dtype"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"{meta_path}: not a prepare-data meta.json ({e!r}); prepare the dataset again"
            ) from None
        tokens_bin = Path(path) / "tokens.bin"
        size = tokens_bin.stat().st_size if tokens_bin.is_file() else None
        if size != n * dtype.itemsize:
            raise ValueError(
                f"{tokens_bin}: {'missing' if size is None else f'{size} bytes'}, but meta.json says"
                f" {n} tokens of {dtype.name} ({n * dtype.itemsize} bytes): the file is incomplete or from"
                " another dataset; prepare the dataset again with `pith-train prepare-data`"
            )
        self.tokens = np.memmap(tokens_bin, dtype=dtype, mode="r", shape=(n,))
        self.doc_ends = np.fromfile(Path(path) / "doc_ends.bin", dtype=np.int64)

    def check_tokenizer(self, tok: ByteTokenizer | HFTokenizer) -> None:
        m = self.meta
        if m["tokenizer_hash"] != tok.hash:
            raise ValueError(
                f"dataset {self.path} was made with tokenizer {m['tokenizer']} (hash {m['tokenizer_hash']}),"
                f" but data.tokenizer is {tok.name} (hash {tok.hash})"
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


def windows(tokens: np.ndarray, seq_len: int, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([tokens[i * seq_len : (i + 1) * seq_len + 1] for i in ids]).astype(np.int64)
    # Two tensors, not two views of one: a caller writing labels (val_batches' padding) leaves inputs.
    return torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(rows[:, 1:].copy())


class WindowLoader:
    """Windows of a PackedDataset (validation ones of `val_ds` when given); a step's depend only on
    (seed, cursor)."""

    def __init__(self, ds: PackedDataset, seq_len: int, val_windows: int, seed: int, val_ds=None):
        self.tokens, self.S, self.seed = ds.tokens, seq_len, seed
        val_from = val_ds or ds
        total, val_total = ds.num_windows(seq_len), val_from.num_windows(seq_len)
        held = 0 if val_ds else val_windows
        train_needs = f"{held} held out (data.val_windows) and one to train"
        for d, n, need, what in ((ds, total, held + 1, train_needs), (val_from, val_total, val_windows, "")):
            if n < need:
                raise ValueError(
                    f"dataset {d.path} has {n} windows of data.seq_len={seq_len}, fewer than {need}"
                    f" ({what or 'data.val_windows'}): lower data.val_windows or data.seq_len"
                )
        self.val_tokens = val_from.tokens
        # the middle window of each of val_windows parts: a corpus's tail is often one document
        self.val_ids = (2 * np.arange(val_windows) + 1) * val_total // (2 * val_windows)
        self.train_ids = np.setdiff1d(np.arange(total), self.val_ids) if held else np.arange(total)
        self.num_train = len(self.train_ids)
        self._epoch, self._order = -1, None

    def _train_id(self, k: int) -> int:
        epoch, i = divmod(k, self.num_train)
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch, self._order = epoch, rng.permutation(self.num_train)
        return int(self.train_ids[self._order[i]])

    def step_batch(
        self, cursor: int, global_batch: int, micro_batch: int, rank: int = 0, ranks: int = 1
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for j in range(global_batch // (micro_batch * ranks)):
            first = cursor + (j * ranks + rank) * micro_batch
            ids = np.array([self._train_id(k) for k in range(first, first + micro_batch)])
            out.append(windows(self.tokens, self.S, ids))
        return out

    def val_batches(self, micro_batch: int, rank: int = 0, ranks: int = 1, ignore_index: int = -100):
        """This rank's share of the validation windows, sliced as step_batch slices a step; rows past
        the last window repeat it with every label `ignore_index`, so all ranks run as many batches."""
        n, per_round = len(self.val_ids), micro_batch * ranks
        for first in range(0, n, per_round):
            ids = np.arange(first + rank * micro_batch, first + (rank + 1) * micro_batch)
            inputs_BS, labels_BS = windows(self.val_tokens, self.S, self.val_ids[np.minimum(ids, n - 1)])
            labels_BS[torch.from_numpy(ids >= n)] = ignore_index
            yield inputs_BS, labels_BS
