"""A process group as a rank holds it: the global ranks it spans and torch's handle of it."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class Group:
    """A group the Communicator runs a collective or a message through. Its ranks say which
    path (native or bridge) the bytes take; its handle is what torch needs."""

    ranks: tuple[int, ...]
    """Its global ranks, in the order it was created with."""
    handle: dist.ProcessGroup | None = None
    """torch's group; None where it never communicates from this rank: a group of one rank, or
    one this rank is not in."""

    @property
    def size(self) -> int:
        """How many ranks it spans."""
        return len(self.ranks)
