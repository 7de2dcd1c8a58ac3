"""Megatron-LM's indexed dataset: a ``.bin`` of tokens and an ``.idx`` that describes it, bit for
bit as Megatron-core's ``megatron/core/datasets/indexed_dataset.py`` writes and reads them, so
that a corpus made by Megatron's ``tools/preprocess_data.py`` trains here and one made by
``hethub data prepare`` trains there.

The ``.idx``, little-endian, one field after another:

    b"MMIDIDX\\x00\\x00"   9 bytes, the magic
    version               uint64, 1
    dtype code            uint8: Megatron's DType (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                          6 float64, 7 float32, 8 uint16)
    sequence count        uint64, n
    document count        uint64, d: the length of the document indices (documents + 1)
    sequence lengths      int32 x n, tokens
    sequence pointers     int64 x n, byte offsets into the .bin
    document indices      int64 x d: document k is sequences [idx[k], idx[k + 1])

(a multimodal index has one int8 mode per sequence after them; hethub neither writes nor reads
it). The ``.bin`` is the sequences' tokens one after another in that dtype. hethub writes one
sequence per document, as preprocess_data.py does without ``--split-sentences``.
"""

from __future__ import annotations

import struct
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from hethub.errors import HethubError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")
"""magic, version, dtype code, sequence count, document count: 34 bytes."""
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
"""Megatron-core's DType enum: the code in an .idx and the numpy dtype of its .bin."""
TOKEN_DTYPES = {np.dtype(t) for t in (np.uint8, np.int8, np.int16, np.int32, np.int64, np.uint16)}
"""The codes a corpus of token ids may have: the integer ones."""
UINT16_VOCAB = 65500
"""Megatron-core's DType.optimal_dtype: uint16 below this vocabulary, int32 from it. Kept as
Megatron has it (not 65536), so that both tools write the same file for the same tokenizer."""
CHUNK = 1 << 20
"""Index entries written at a time: the pointers and document indices of a corpus of any size
are written chunk by chunk, never built whole."""


def token_dtype(vocab: int) -> np.dtype:
    """The dtype of a corpus of a ``vocab``-token vocabulary: uint16 where Megatron's rule says it
    fits, int32 beyond (Llama 3's 128,256 and Qwen2's 151,936 tokens)."""
    return np.dtype(np.uint16 if vocab < UINT16_VOCAB else np.int32)


def dtype_code(dtype: np.dtype) -> int:
    """The .idx code of ``dtype``."""
    return next(code for code, t in DTYPE_CODES.items() if np.dtype(t) == dtype)


class IndexedWriter:
    """Writes PREFIX.bin and PREFIX.idx a document at a time: tokens go to the .bin as they come;
    only the sequence lengths (4 bytes a document) are kept until :meth:`finish` writes the
    index."""

    def __init__(self, prefix: Path, dtype: np.dtype) -> None:
        self.prefix, self.dtype = Path(prefix), np.dtype(dtype)
        self._bin: BinaryIO = open(self.prefix.with_suffix(".bin"), "wb")  # noqa: SIM115
        self._lengths = array("i")  # int32, as the .idx holds them
        self.tokens = 0

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents: ``tokens`` their ids one after another (already in the writer's
        dtype), ``lengths`` each one's token count (one sequence each)."""
        if tokens.dtype != self.dtype or int(lengths.sum()) != len(tokens):
            raise ValueError("tokens must be in the writer's dtype and add up to the lengths")
        self._bin.write(tokens.tobytes())
        self._lengths.extend(lengths.astype(np.int32).tolist())
        self.tokens += len(tokens)

    @property
    def documents(self) -> int:
        return len(self._lengths)

    def finish(self) -> None:
        """Close the .bin and write the .idx (the pointers and the document indices chunk by
        chunk)."""
        self._bin.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int32)
        count = len(lengths)
        with open(self.prefix.with_suffix(".idx"), "wb") as idx:
            idx.write(HEADER.pack(MAGIC, VERSION, dtype_code(self.dtype), count, count + 1))
            idx.write(lengths.tobytes())
            offset = 0
            for start in range(0, count, CHUNK):
                sizes = lengths[start : start + CHUNK].astype(np.int64) * self.dtype.itemsize
                ends = offset + np.cumsum(sizes)
                idx.write((ends - sizes).tobytes())
                offset = int(ends[-1])
            # One sequence per document: document k is sequence k; d + 1 entries, from 0.
            for start in range(0, count + 1, CHUNK):
                idx.write(np.arange(start, min(start + CHUNK, count + 1), dtype=np.int64).tobytes())


@dataclass(frozen=True)
class IndexFile:
    """An .idx's header, and its arrays read through a memory map (never loaded whole)."""

    path: Path
    dtype: np.dtype
    sequences: int
    documents: int
    """The document indices' length: documents + 1."""

    @property
    def _offsets(self) -> tuple[int, int, int]:
        lengths = HEADER.size
        pointers = lengths + 4 * self.sequences
        return lengths, pointers, pointers + 8 * self.sequences

    def sequence_lengths(self) -> np.ndarray:
        return np.memmap(self.path, np.int32, "r", self._offsets[0], (self.sequences,))

    def sequence_pointers(self) -> np.ndarray:
        return np.memmap(self.path, np.int64, "r", self._offsets[1], (self.sequences,))

    def document_indices(self) -> np.ndarray:
        return np.memmap(self.path, np.int64, "r", self._offsets[2], (self.documents,))


def read_index(path: Path, what: str) -> IndexFile:
    """The header of the .idx at ``path``, checked: magic, version, an integer dtype, a size that
    holds the arrays it announces. ``what`` names the corpus in the one-line error."""
    with open(path, "rb") as idx:
        head = idx.read(HEADER.size)
    if len(head) < HEADER.size or not head.startswith(MAGIC):
        raise HethubError(f"{what}: {path.name} is not a Megatron-LM index (no MMIDIDX header)")
    _, version, code, sequences, documents = HEADER.unpack(head)
    if version != VERSION:
        raise HethubError(f"{what}: {path.name} has index version {version}; hethub reads 1")
    if code not in DTYPE_CODES or np.dtype(DTYPE_CODES[code]) not in TOKEN_DTYPES:
        raise HethubError(
            f"{what}: {path.name} has dtype code {code}; token ids must be integers "
            f"(codes {sorted(dtype_code(t) for t in TOKEN_DTYPES)})"
        )
    index = IndexFile(path, np.dtype(DTYPE_CODES[code]), sequences, documents)
    needed = index._offsets[2] + 8 * documents
    if path.stat().st_size < needed:
        raise HethubError(
            f"{what}: {path.name} is {path.stat().st_size} bytes, shorter than the {needed} its "
            f"header announces ({sequences} sequences, {documents} document indices)"
        )
    return index
