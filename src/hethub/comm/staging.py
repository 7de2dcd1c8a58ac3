"""Host buffers for the bridge, kept across steps.

gloo reads and writes host memory, so a tensor on an accelerator crosses the bridge through a
host copy; pinned, so that the device copies it at full speed and without blocking. Pinning is
slow (it maps pages for the device), so a buffer is made once and lent again every step: the
pool keeps every buffer it made, and lends a free one large enough (or grows a free one) before
it makes another. A buffer is free again once what last used it is done (the message sent, the
copy back to the device finished), which the borrower says when it gives the buffer back; so
the pool holds as many buffers as messages are under way at once, not one per message.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Done = Callable[[], bool]
"""Whether what last used a buffer is finished (a Work's is_completed, an Event's query)."""


def _taken() -> bool:
    return False


def _free() -> bool:
    return True


@dataclass(eq=False, slots=True)
class _Slot:
    buffer: torch.Tensor
    done: Done
    """Whether the buffer is free: what last used it has finished."""


class StagingPool:
    """Flat host buffers lent by element count and dtype."""

    def __init__(self, *, pin: bool = True) -> None:
        """``pin``: pinned memory (it needs an accelerator; a CPU-only run never stages)."""
        self.pin = pin
        self._buffers: list[_Slot] = []  # every buffer made and kept
        self.made = 0
        """How many buffers the pool has allocated, growing included (tests and benchmarks)."""

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor of ``numel`` elements of ``dtype`` (its contents undefined), lent
        until ``give_back``."""
        free = [slot for slot in self._buffers if slot.buffer.dtype == dtype and slot.done()]
        fitting = [slot for slot in free if slot.buffer.numel() >= numel]
        if fitting:
            slot = min(fitting, key=lambda s: s.buffer.numel())
        else:  # grow a free one rather than keep both
            if free:
                self._buffers.remove(free[0])
            slot = _Slot(torch.empty(numel, dtype=dtype, pin_memory=self.pin), _free)
            self._buffers.append(slot)
            self.made += 1
        slot.done = _taken
        return slot.buffer[:numel]

    def give_back(self, buffer: torch.Tensor, done: Done = _free) -> None:
        """Lend ``buffer`` (a tensor ``take`` gave) again once ``done`` says its last use ended."""
        for slot in self._buffers:
            if slot.buffer.data_ptr() == buffer.data_ptr():
                slot.done = done
                return
        raise ValueError("a staging buffer given back that the pool did not lend")
