"""Where each of a rank's parameters lives in its flat buffers (Megatron-core's
ParamAndGradBuffer): its weights, their fp32 main gradients and, in bf16, the fp32 master
weights are each one contiguous buffer over all the rank's chunks, every parameter a view of
its span.

The gradient sync's buckets (spec.buckets.rank_buckets) come first, in the order it runs them,
each one contiguous slice, so a bucket is summed in place. A bucket is padded with zeros to a
multiple of a sharded optimizer's shards, so each rank's shard of it is one contiguous slice too
(updated and gathered in place). The parameters in no bucket (held by this stage alone) come
after, in the order given. So a whole buffer is zeroed or copied in one operation.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class BucketSpan:
    """One bucket's place in the flat buffers."""

    names: tuple[str, ...]
    """Its parameters' full-model names, in the buffer's order."""
    start: int
    used: int
    """Where its parameters end: [start, used) holds them."""
    stop: int
    """Where its padding ends: [used, stop) is zeros, stop - start a multiple of the shards."""


class FlatLayout:
    """The spans of a rank's parameters in its flat buffers (see the module's docstring)."""

    def __init__(
        self,
        shapes: Mapping[str, Sequence[int]],
        buckets: Sequence[Sequence[str]] = (),
        shards: int = 1,
    ) -> None:
        """``shapes``: every parameter's local shape by full-model name, in the order the
        parameters in no bucket take; ``buckets``: the gradient sync's buckets' names, in its
        order; ``shards``: the ranks a sharded optimizer splits each bucket over (1: none)."""
        if shards < 1:
            raise ValueError(f"a bucket is split over at least 1 shard, not {shards}")
        self.shapes = {name: tuple(shape) for name, shape in shapes.items()}
        self.shards = shards
        self.spans: dict[str, tuple[int, int]] = {}
        self.buckets: list[BucketSpan] = []
        end = 0
        for names in buckets:
            start = end
            for name in names:
                end = self._place(name, end)
            used, end = end, end + (-(end - start) % shards)
            self.buckets.append(BucketSpan(tuple(names), start, used, end))
        self.unbucketed = tuple(name for name in self.shapes if name not in self.spans)
        for name in self.unbucketed:
            end = self._place(name, end)
        self.numel = end
        """The buffers' length, padding included."""

    def _place(self, name: str, start: int) -> int:
        if name not in self.shapes:
            raise ValueError(f"bucketed parameter {name} is not one of the rank's")
        if name in self.spans:
            raise ValueError(f"parameter {name} is in two buckets")
        stop = start + math.prod(self.shapes[name])
        self.spans[name] = (start, stop)
        return stop

    def view(self, flat: torch.Tensor, name: str, *, offset: int = 0) -> torch.Tensor:
        """Parameter ``name``'s span of ``flat``, in its shape: ``flat`` is a flat buffer, or
        its part from ``offset`` on (a bucket's)."""
        start, stop = self.spans[name]
        return flat[start - offset : stop - offset].view(self.shapes[name])

    def bucket(self, flat: torch.Tensor, index: int, *, padded: bool = False) -> torch.Tensor:
        """Bucket ``index``'s slice of ``flat``: its parameters, or with its padding."""
        span = self.buckets[index]
        return flat[span.start : span.stop if padded else span.used]

    def shard(self, index: int, rank: int) -> tuple[int, int]:
        """(start, stop) in the buffers of shard ``rank`` of bucket ``index`` (padding
        included): the ``rank``-th of ``shards`` equal slices."""
        span = self.buckets[index]
        size = (span.stop - span.start) // self.shards
        return span.start + rank * size, span.start + (rank + 1) * size

    def padding(self) -> list[tuple[int, int]]:
        """The (start, stop) of every bucket's padding."""
        return [(span.used, span.stop) for span in self.buckets if span.stop > span.used]
