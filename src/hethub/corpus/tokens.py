"""A corpus's tokens end to end, read where they lie: files (and small arrays in memory, such as
the separators between text files) taken as one stream without joining them, never loaded
whole and never widened; only the windows asked for are copied, to int64.

The files are read with positioned reads (pread) from the page cache, not through a memory
map. A mapped file's pages count in the process's resident memory once touched, and the kernel
maps whole page-cache folios around each one, so random windows drawn through a map grow the
process by far more than they hold, and unmapping as it goes costs more than reading; pread
takes the same bytes from the same shared cache and adds nothing to the process but the batch
itself (docs/formats.md, how a corpus is read).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SCAN_CHUNK = 1 << 22
"""Tokens read at a time when a corpus is scanned for its extreme ids: 8-16 MB."""
OPEN_FILES = 64
"""Files a stream keeps open at once (a folder of text may hold thousands)."""


@dataclass(frozen=True, eq=False)
class TokenPart:
    """One stretch of tokens: a file's, from a byte offset to its end, or an array in memory."""

    dtype: np.dtype
    length: int
    array: np.ndarray | None = None
    path: Path | None = None
    offset: int = 0

    @classmethod
    def memory(cls, tokens: np.ndarray) -> TokenPart:
        return cls(tokens.dtype, len(tokens), array=tokens)

    @classmethod
    def file(cls, path: Path, dtype: np.dtype, offset: int = 0) -> TokenPart:
        """The tokens of ``path`` from byte ``offset`` to its end, as ``dtype``."""
        dtype = np.dtype(dtype)
        length = max(path.stat().st_size - offset, 0) // dtype.itemsize
        return cls(dtype, length, path=path, offset=offset)


class TokenStream:
    """Parts one after another, read as one sequence of tokens."""

    def __init__(self, parts: Sequence[TokenPart]) -> None:
        self.parts = [part for part in parts if part.length]
        self.starts = np.cumsum([0, *(part.length for part in self.parts)])
        self.dtypes = {part.dtype for part in self.parts}
        self._files: OrderedDict[Path, int] = OrderedDict()

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __del__(self) -> None:
        for descriptor in getattr(self, "_files", {}).values():
            os.close(descriptor)

    def rows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """int64 (len(starts), length): row i the ``length`` tokens from ``starts[i]``, which
        must end within the stream."""
        out = np.empty((len(starts), length), dtype=np.int64)
        for row, start in zip(out, starts.tolist()):
            part = int(np.searchsorted(self.starts, start, side="right")) - 1
            filled = 0
            while filled < length:  # a window crosses from one part into the next
                local = start + filled - int(self.starts[part])
                count = min(length - filled, self.parts[part].length - local)
                row[filled : filled + count] = self._read(self.parts[part], local, count)
                filled += count
                part += 1
        return out

    def _read(self, part: TokenPart, first: int, count: int) -> np.ndarray:
        if part.array is not None:
            return part.array[first : first + count]
        tokens = np.empty(count, dtype=part.dtype)
        done = os.preadv(
            self._descriptor(part.path), [tokens], part.offset + first * part.dtype.itemsize
        )
        if done != tokens.nbytes:
            raise OSError(
                f"{part.path}: short read ({done} of {tokens.nbytes} bytes); did it shrink?"
            )
        return tokens

    def _descriptor(self, path: Path) -> int:
        if path in self._files:
            self._files.move_to_end(path)
        else:
            if len(self._files) >= OPEN_FILES:
                os.close(self._files.popitem(last=False)[1])
            self._files[path] = os.open(path, os.O_RDONLY)
        return self._files[path]

    def chunks(self) -> Iterator[np.ndarray]:
        """Every token, SCAN_CHUNK at a time (bounded memory)."""
        for part in self.parts:
            for first in range(0, part.length, SCAN_CHUNK):
                yield self._read(part, first, min(SCAN_CHUNK, part.length - first))

    def extremes(self) -> tuple[int, int]:
        """The smallest and the largest token id, read chunk by chunk."""
        lows, highs = [], []
        for chunk in self.chunks():
            lows.append(int(chunk.min()))
            highs.append(int(chunk.max()))
        return min(lows, default=0), max(highs, default=0)
