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


@dataclass(frozen=True, slots=True)
class SlicedBridge:
    """The groups a tensor summed across vendors crosses the bridge in, one per slice
    (spec.slices.bridge_slices of ``parts``)."""

    parts: tuple[tuple[int, ...], ...]
    """Each vendor's holders of the tensor, in the order their reduce-scatter cuts it."""
    groups: tuple[Group, ...]
    """One per slice, in the tensor's order: the slice's owner on each vendor. A group's handle
    is only on its own ranks."""

    def part_of(self, rank: int) -> tuple[int, ...]:
        """The holders of ``rank``'s vendor."""
        return next(part for part in self.parts if rank in part)
