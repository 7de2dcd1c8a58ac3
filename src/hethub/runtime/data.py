"""Training data: token streams (the built-in corpus, a text file, a folder of text files, or a
nanoGPT-style .bin of uint16 tokens) and the global batches drawn from them, the same for a given
seed whatever the plan."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hethub.errors import HethubError

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".text")


def builtin_corpus() -> torch.Tensor:
    """The standard library's pydoc topic texts as byte tokens (vocabulary 256); no download."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


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
