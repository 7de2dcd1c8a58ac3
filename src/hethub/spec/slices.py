"""How a tensor summed across vendors is cut so that every holder carries its share over the
bridge: a pure function of the holders (no torch), the same on every rank, which the process
groups (one bridge group per slice) and the Communicator's sliced all-reduce both read.

Inside each vendor the k holders reduce-scatter the tensor natively into k equal pieces, so
holder i of a vendor owns piece i. Vendors with different holder counts cut at different
places; the slices are the pieces cut at every vendor's boundaries at once. Each slice then
lies inside exactly one piece of every vendor, so it crosses the bridge among those owners (one
rank per vendor), and no rank carries more than its own piece: with k holders a vendor, 1/k of
the tensor, where the funnel sent it all out of one rank. The tensor is padded to a multiple of
the lowest common multiple of the holder counts, so that every boundary falls on an element.

Before that, a bucket's holders are its stages' TP ranks, each holding its own shard of every
TP-split tensor (``sync_classes``): each class of ranks, one from each holder stage, sums the
shares they all hold, so no gradient is gathered to a stage leader, and between unlike TP
degrees the classes follow the tensors' layout, not the TP rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise
from typing import NamedTuple

from hethub.memo import memoized


class BridgeSlice(NamedTuple):
    """One slice of a tensor summed across vendors, in units of 1 / ``slice_units`` of it."""

    start: int
    stop: int
    ranks: tuple[int, ...]
    """The rank owning it on each vendor, in the vendors' order: its bridge group."""


def slice_units(parts: Sequence[Sequence[int]]) -> int:
    """In how many equal units the slices of a tensor held by ``parts`` (each vendor's
    holders) are measured: the lowest common multiple of the holder counts."""
    return math.lcm(*(len(part) for part in parts))


def bridge_slices(parts: Sequence[Sequence[int]]) -> tuple[BridgeSlice, ...]:
    """The slices of a tensor held by ``parts`` (each vendor's holders, in their order), in
    the tensor's order: at most the total holder count, less one per vendor after the first.
    Vendors of 2 and 3 holders give 4 slices, of 1/3, 1/6, 1/6 and 1/3."""
    return _bridge_slices(tuple(tuple(part) for part in parts))


@memoized
def _bridge_slices(parts: tuple[tuple[int, ...], ...]) -> tuple[BridgeSlice, ...]:
    """bridge_slices, made once per holder set (every rank of a class asks)."""
    units = slice_units(parts)
    cuts = sorted({i * units // len(part) for part in parts for i in range(len(part))} | {units})
    return tuple(
        BridgeSlice(start, stop, tuple(part[start * len(part) // units] for part in parts))
        for start, stop in pairwise(cuts)
    )


def padded_length(numel: int, parts: Sequence[Sequence[int]]) -> int:
    """How many elements a tensor of ``numel`` is summed as: rounded up to a multiple of
    slice_units (the padding moves as zeros)."""
    units = slice_units(parts)
    return -(-numel // units) * units


def vendor_parts(ranks: Sequence[int], vendors: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """``ranks`` split by vendor, each part sorted, the parts in the order of their first rank."""
    parts: dict[str, list[int]] = {}
    for rank in sorted(ranks):
        parts.setdefault(vendors[rank], []).append(rank)
    return tuple(tuple(part) for part in parts.values())


class SyncClass(NamedTuple):
    """The part of a bucket one rank of each holder stage sums together: TP ranks hold unlike
    shares of a TP-split tensor where the stages' TP degrees differ, so a bucket is summed in
    classes, each among the ranks whose shares overlap on one run of every split dimension
    (in units of 1 / ``units`` of it), and each rank sums only what it holds."""

    start: int
    stop: int
    units: int
    """The lowest common multiple of the holder stages' TP degrees."""
    ranks: tuple[int, ...]
    """The rank of each holder stage (in the stages' order) whose share covers [start, stop)."""


def sync_classes(stages: Sequence[Sequence[int]]) -> tuple[SyncClass, ...]:
    """The classes a bucket held by ``stages`` (each holder stage's TP ranks, in TP order) is
    summed in, in the order of their runs. Stages of one TP degree t give t classes, rank i of
    every stage in the i-th (each TP rank sums its own shard with its peers); TP 2 beside TP 1
    gives two, the TP-1 rank in both. A tensor whole on every TP rank (a norm's weight) is
    summed in every class a rank is in, so each TP rank gets the sum without a broadcast."""
    return _sync_classes(tuple(tuple(stage) for stage in stages))


@memoized
def _sync_classes(stages: tuple[tuple[int, ...], ...]) -> tuple[SyncClass, ...]:
    """sync_classes, made once per holder set."""
    units = math.lcm(*(len(stage) for stage in stages))
    classes: list[SyncClass] = []
    for unit in range(units):
        ranks = tuple(stage[unit * len(stage) // units] for stage in stages)
        if classes and classes[-1].ranks == ranks:  # each coordinate only grows with the unit
            classes[-1] = classes[-1]._replace(stop=unit + 1)
        else:
            classes.append(SyncClass(unit, unit + 1, units, ranks))
    return tuple(classes)
