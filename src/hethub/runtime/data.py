"""Training data: byte-level tokens of a text every Python installation carries, and the global
batches drawn from it, the same for a given seed whatever the plan."""

from __future__ import annotations

import torch


def builtin_corpus() -> torch.Tensor:
    """The standard library's pydoc topic texts as byte tokens (vocabulary 256); no download."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def global_batch(corpus: torch.Tensor, step: int, sequences: int, seq_len: int, seed: int) -> torch.Tensor:
    """The ``step``-th global batch: ``sequences`` windows of seq_len + 1 tokens at seeded offsets."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(corpus) - seq_len - 1, (sequences,), generator=gen)
    return torch.stack([corpus[s: s + seq_len + 1] for s in starts.tolist()])
