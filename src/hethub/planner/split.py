"""Micro-batches per replica: an uneven data-parallel split that finishes every replica together.

A replica of a layout takes about fill + m * bottleneck for m micro-batches (bottleneck: its
slowest stage per micro-batch; fill: the rest of one pass through the pipeline). The split
minimises the slowest replica: the least T at which sum over replicas of floor((T - fill) /
bottleneck) reaches the total, found by bisection and then made exact by handing the last
micro-batches to the replicas that finish them first.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReplicaTiming:
    count: int
    """Identical replicas of this layout."""
    bottleneck_s: float
    fill_s: float


def split_micro_batches(
    total: int, layouts: list[ReplicaTiming]
) -> list[list[tuple[int, int]]] | None:
    """Per layout, [(replicas, micro-batches each), ...] with every replica running at least one.

    None when there are more replicas than micro-batches.
    """
    replicas = sum(layout.count for layout in layouts)
    if total < replicas:
        return None
    # Every replica's count at the balanced time, rounded down, then the remainder one by one.
    low = min(l.fill_s + l.bottleneck_s for l in layouts)
    high = max(l.fill_s + l.bottleneck_s * total for l in layouts)
    for _ in range(100):
        middle = (low + high) / 2
        if _assigned(middle, layouts) >= total:
            high = middle
        else:
            low = middle
    base = [max(1, math.floor((low - l.fill_s) / l.bottleneck_s)) for l in layouts]
    while sum(b * l.count for b, l in zip(base, layouts)) > total:  # never more than the total
        i = max(
            range(len(layouts)),
            key=lambda k: (
                layouts[k].fill_s + base[k] * layouts[k].bottleneck_s if base[k] > 1 else -math.inf
            ),
        )
        base[i] -= 1
    extra = [0] * len(layouts)
    left = total - sum(b * l.count for b, l in zip(base, layouts))
    heap = [(l.fill_s + (base[i] + 1) * l.bottleneck_s, i) for i, l in enumerate(layouts)]
    heapq.heapify(heap)
    while left > 0:
        finish, i = heapq.heappop(heap)
        extra[i] += 1
        left -= 1
        if extra[i] < layouts[i].count:
            heapq.heappush(heap, (finish, i))
    result = []
    for b, e, layout in zip(base, extra, layouts):
        parts = [(layout.count - e, b), (e, b + 1)]
        result.append([(count, m) for count, m in parts if count > 0])
    return result


def _assigned(time: float, layouts: list[ReplicaTiming]) -> int:
    return sum(l.count * max(0, math.floor((time - l.fill_s) / l.bottleneck_s)) for l in layouts)
