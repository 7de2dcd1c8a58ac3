"""Training data, the runtime's side: a batch's tokens onto the device (to_device), and the older
in-memory readers (builtin_corpus, load_tokens, check_tokens, global_batch) that the callers
not yet moved to hethub.corpus's open_corpus still use. The corpora themselves, memory-mapped
and shuffled by epoch, are hethub.corpus's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hethub.corpus.sources import TEXT_SUFFIXES, builtin_text
from hethub.errors import HethubError


def builtin_corpus() -> torch.Tensor:
    """The standard library's pydoc topic texts as byte tokens (vocabulary 256); no download."""
    return torch.frombuffer(bytearray(builtin_text()), dtype=torch.uint8).long()


def global_batch(
    corpus: torch.Tensor, step: int, sequences: int, seq_len: int, seed: int
) -> torch.Tensor:
    """The ``step``-th global batch: ``sequences`` windows of seq_len + 1 tokens at seeded
    offsets."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(corpus) - seq_len - 1, (sequences,), generator=gen)
    return torch.stack([corpus[s : s + seq_len + 1] for s in starts.tolist()])


def to_device(tokens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tokens`` on ``device``, copied without making the host wait: staged through pinned
    (page-locked) host memory where the device is an accelerator, which copies from it
    asynchronously; on the CPU the tensor itself."""
    if device.type != "cpu":
        tokens = tokens.pin_memory()
    return tokens.to(device, non_blocking=True)


def load_tokens(path: str | Path) -> torch.Tensor:
    """Tokens from ``path``: a .bin of uint16 tokens (nanoGPT), a text file, or a folder of text
    files (byte tokens, files in name order). Missing or empty data is a HethubError."""
    path = Path(path)
    if not path.exists():
        raise HethubError(f"--data = {str(path)!r}: no such file or folder")
    if path.is_dir():
        files = sorted(
            p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES
        )
        if not files:
            raise HethubError(
                f"--data = {str(path)!r}: the folder holds no text files "
                f"({', '.join(TEXT_SUFFIXES)})"
            )
        data = b"\n\n".join(p.read_bytes() for p in files)
        tokens = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
            if data
            else torch.empty(0, dtype=torch.long)
        )
    elif path.suffix == ".bin":
        raw = np.fromfile(path, dtype=np.uint16)
        tokens = torch.from_numpy(raw.astype(np.int64))
    else:
        data = path.read_bytes()
        tokens = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
            if data
            else torch.empty(0, dtype=torch.long)
        )
    if len(tokens) == 0:
        raise HethubError(f"--data = {str(path)!r}: empty, no tokens to train on")
    return tokens


def check_tokens(
    tokens: torch.Tensor, source: str, vocab: int, seq_len: int, sequences: int
) -> None:
    """Refuse data that cannot fill one global batch or that holds tokens beyond the vocabulary."""
    needed = (
        seq_len + 1 + sequences
    )  # a window of seq_len + 1 tokens at `sequences` distinct offsets
    if len(tokens) < needed:
        raise HethubError(
            f"{source}: {len(tokens)} tokens, shorter than one batch of {sequences} sequences of "
            f"{seq_len + 1} tokens (needs at least {needed})"
        )
    top = int(tokens.max())
    if top >= vocab:
        raise HethubError(f"{source}: token {top} is outside the model's vocabulary of {vocab}")
