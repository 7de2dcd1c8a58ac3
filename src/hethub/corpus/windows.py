"""Corpora as training reads them: windows of seq_len + 1 tokens, in a seeded order shuffled
anew each epoch, or in document order for evaluation.

Packing: documents lie one after another across their boundaries, each ended by its EOS, as
Megatron-LM packs them by default (its GPTDataset, without resetting positions or attention at
a document's end): a window may end one document and begin the next; nothing is padded, and
nothing is dropped but a tail shorter than a window.

Windows: with L = seq_len, window i is tokens [i·L, i·L + L], L + 1 tokens: its first L the
input and its last L the targets. Consecutive windows share one token, so every token but the
first is a target exactly once an epoch; a corpus of N tokens has (N - 1) // L windows.

Order: a run's sequences s = 0, 1, 2, ... (its position in the data is the number it has
consumed) run through the epochs one after another. Epoch e = s // W takes the W windows in the
order of a permutation of range(W) drawn by numpy's Generator seeded with (seed, e): each window
once an epoch, and the rows of a batch depend on its first sequence, its count and the seed
alone, whatever the plan. A batch costs the permutation of its epoch, made once and kept: an
int64 per window, 19 MB for 10 billion tokens at L = 4096, whatever ``first`` is.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

import numpy as np
import torch

from hethub.corpus.tokens import TokenStream
from hethub.errors import HethubError

BLEND_BLOCK = 10_000
"""A blend deals its sequences in blocks of this many: each block holds every part's share,
rounded (largest remainders), in a seeded order."""
KEPT_ORDERS = 2
"""Permutations (epochs, or a blend's blocks) kept at once: a batch may straddle two."""
Kept = TypeVar("Kept")


class Corpus(ABC):
    """The training or evaluation data of a run: what ``--data`` names, opened."""

    name: str
    """What to call it in messages: the path or the blend as given, or 'the built-in corpus'."""
    tokenizer_dir: Path | None
    """The prepared folder's copy of its tokenizer's files, where it was prepared with one."""

    @abstractmethod
    def __len__(self) -> int:
        """Tokens."""

    @abstractmethod
    def windows(self, seq_len: int) -> int:
        """Windows of seq_len + 1 tokens an epoch."""

    @abstractmethod
    def check(self, vocab: int, seq_len: int, sequences: int) -> None:
        """HethubError, in one line, where the corpus cannot fill one batch of ``sequences``
        windows or holds a token id of ``vocab`` or more."""

    @abstractmethod
    def sequences(self, indices: np.ndarray, seq_len: int, key: tuple[int, ...]) -> np.ndarray:
        """int64 (len(indices), seq_len + 1): the shuffled stream's sequences ``indices``, the
        stream drawn from the seed sequence ``key``."""

    @abstractmethod
    def consecutive(self, first: int, count: int, seq_len: int) -> torch.Tensor:
        """int64 (n, seq_len + 1): windows ``first`` .. ``first + count - 1`` in document order,
        for evaluation; fewer rows (n < count) where the data ends."""

    def batch(self, first: int, count: int, seq_len: int, seed: int) -> torch.Tensor:
        """int64 (count, seq_len + 1): sequences ``first`` .. ``first + count - 1`` of the seeded,
        shuffled stream (each window once an epoch, epochs one after another)."""
        indices = np.arange(first, first + count, dtype=np.int64)
        return torch.from_numpy(self.sequences(indices, seq_len, (seed,)))


class _KeptOrders(Generic[Kept]):
    """The last few permutations made, by their key: a batch asks for one or two of them."""

    def __init__(self) -> None:
        self._orders: dict[tuple, Kept] = {}

    def get(self, key: tuple, make: Callable[[], Kept]) -> Kept:
        if key not in self._orders:
            if len(self._orders) >= KEPT_ORDERS:
                del self._orders[next(iter(self._orders))]
            self._orders[key] = make()
        return self._orders[key]


class TokenCorpus(Corpus):
    """One stream of tokens: a prepared folder, a Megatron-LM prefix, nanoGPT's .bin, text."""

    def __init__(
        self,
        name: str,
        tokens: TokenStream,
        *,
        vocab: int | None = None,
        tokenizer: str | None = None,
        tokenizer_dir: Path | None = None,
    ) -> None:
        """``vocab``: the vocabulary its ids come from where known (a prepared folder's
        tokenizer, 256 for bytes): ids beyond it cannot occur. ``tokenizer``: what made the
        ids ('bytes', a tokenizer's SHA-256, or None where unknown), which a blend's parts must
        share."""
        self.name, self.tokens, self.vocab = name, tokens, vocab
        self.tokenizer, self.tokenizer_dir = tokenizer, tokenizer_dir
        self._orders: _KeptOrders[np.ndarray] = _KeptOrders()

    def __len__(self) -> int:
        return len(self.tokens)

    def windows(self, seq_len: int) -> int:
        return max(len(self) - 1, 0) // seq_len

    def check(self, vocab: int, seq_len: int, sequences: int) -> None:
        if self.windows(seq_len) < sequences:
            raise HethubError(
                f"{self.name}: {len(self)} tokens, shorter than one batch of {sequences} "
                f"sequences of {seq_len + 1} tokens (needs at least {sequences * seq_len + 1})"
            )
        if self.tokenizer not in (None, "bytes") and self.vocab is not None and self.vocab > vocab:
            raise HethubError(
                f"{self.name}: prepared with a tokenizer of {self.vocab} tokens, more than the "
                f"model's vocabulary of {vocab}"
            )
        bound = self.vocab or max(np.iinfo(t).max + 1 for t in self.tokens.dtypes)
        signed = self.vocab is None and any(t.kind == "i" for t in self.tokens.dtypes)
        if bound <= vocab and not signed:
            return  # no id can fall outside the vocabulary: nothing to read
        low, high = self.tokens.extremes()
        if low < 0:
            raise HethubError(f"{self.name}: token {low} is negative; token ids start at 0")
        if high >= vocab:
            raise HethubError(
                f"{self.name}: token {high} is outside the model's vocabulary of {vocab}"
            )

    def sequences(self, indices: np.ndarray, seq_len: int, key: tuple[int, ...]) -> np.ndarray:
        count = self.windows(seq_len)
        if count == 0:
            raise HethubError(f"{self.name}: {len(self)} tokens, not one window of {seq_len + 1}")
        epochs, positions = np.divmod(indices, count)
        windows = np.empty_like(indices)
        for epoch in np.unique(epochs).tolist():
            order = self._orders.get(
                (key, seq_len, epoch),
                lambda e=epoch: np.random.default_rng((*key, e)).permutation(count),
            )
            here = epochs == epoch
            windows[here] = order[positions[here]]
        return self.tokens.rows(windows * seq_len, seq_len + 1)

    def consecutive(self, first: int, count: int, seq_len: int) -> torch.Tensor:
        stop = min(first + count, self.windows(seq_len))
        starts = np.arange(first, max(stop, first), dtype=np.int64) * seq_len
        return torch.from_numpy(self.tokens.rows(starts, seq_len + 1))


class BlendedCorpus(Corpus):
    """Several corpora, each giving its weight's share of the sequences.

    The sequences are dealt in blocks of BLEND_BLOCK: each block takes round(w_k · BLEND_BLOCK)
    from part k (largest remainders, summing to the block), in an order drawn from
    (seed, 0, block). Part k's sequences are its own shuffled stream, drawn from
    (seed, k + 1): each part's windows once its epoch, whatever the others. So over every block
    the shares hold to 1/BLEND_BLOCK, and a batch costs one or two blocks' orders.
    """

    def __init__(self, name: str, parts: list[tuple[float, TokenCorpus]]) -> None:
        """``parts``: (weight, corpus), the weights positive and summing to 1."""
        self.name, self.parts = name, parts
        shares = np.array([weight for weight, _ in parts]) * BLEND_BLOCK
        per_block = np.floor(shares).astype(np.int64)
        short = BLEND_BLOCK - int(per_block.sum())
        per_block[np.argsort(per_block - shares, kind="stable")[:short]] += 1
        self.per_block = per_block
        self.tokenizer_dir = next(
            (c.tokenizer_dir for _, c in parts if c.tokenizer_dir is not None), None
        )
        self._blocks: _KeptOrders[tuple[np.ndarray, np.ndarray]] = _KeptOrders()

    def __len__(self) -> int:
        return sum(len(corpus) for _, corpus in self.parts)

    def windows(self, seq_len: int) -> int:
        return sum(corpus.windows(seq_len) for _, corpus in self.parts)

    def check(self, vocab: int, seq_len: int, sequences: int) -> None:
        """Each part must fill its share of one batch (at least one window)."""
        for weight, corpus in self.parts:
            corpus.check(vocab, seq_len, max(1, math.ceil(weight * sequences)))

    def _block(self, key: tuple[int, ...], block: int) -> tuple[np.ndarray, np.ndarray]:
        """For each position of ``block``: its part, and its index in that part's stream."""
        part_of = np.repeat(np.arange(len(self.parts)), self.per_block)
        part_of = part_of[np.random.default_rng((*key, 0, block)).permutation(BLEND_BLOCK)]
        local = np.empty(BLEND_BLOCK, dtype=np.int64)
        for part, count in enumerate(self.per_block.tolist()):
            where = np.flatnonzero(part_of == part)
            local[where] = block * count + np.arange(len(where))
        return part_of, local

    def sequences(self, indices: np.ndarray, seq_len: int, key: tuple[int, ...]) -> np.ndarray:
        blocks, positions = np.divmod(indices, BLEND_BLOCK)
        part_of, local = np.empty_like(indices), np.empty_like(indices)
        for block in np.unique(blocks).tolist():
            parts, locals_ = self._blocks.get((key, block), lambda b=block: self._block(key, b))
            here = blocks == block
            part_of[here], local[here] = parts[positions[here]], locals_[positions[here]]
        out = np.empty((len(indices), seq_len + 1), dtype=np.int64)
        for part, (_, corpus) in enumerate(self.parts):
            here = part_of == part
            if here.any():
                out[here] = corpus.sequences(local[here], seq_len, (*key, part + 1))
        return out

    def consecutive(self, first: int, count: int, seq_len: int) -> torch.Tensor:
        """The parts' windows one after another, in the order the blend lists them."""
        pieces, offset = [], 0
        for _, corpus in self.parts:
            windows = corpus.windows(seq_len)
            low, high = max(first - offset, 0), min(first + count - offset, windows)
            if low < high:
                pieces.append(corpus.consecutive(low, high - low, seq_len))
            offset += windows
        return torch.cat(pieces) if pieces else torch.empty(0, seq_len + 1, dtype=torch.long)
