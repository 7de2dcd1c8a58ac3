"""Layers per pipeline stage: an exact solver for non-uniform stages.

A stage with n layers takes w = n * per_layer + extra per micro-batch (forward plus backward; the
extra is the embedding on the first stage and the head on the last). 1F1B over m micro-batches
takes about sum(w) + (m - 1) * max(w), so the split minimises that, with 1 <= n <= cap per stage
(cap: the most layers that fit in the stage's memory at its position).

For a bound B on max(w), the least sum(w) puts every layer beyond each stage's first on the
cheapest stages still under B (a unit-item knapsack, where greedy is exact). The optimum's max(w)
is one of the values w_s(n), so trying each of them, cheapest first, and stopping once
(m - 1) * B alone exceeds the best found, gives the exact optimum.

Interleaved 1F1B over v chunks per stage takes about sum(w) / v + (m - 1 / v) * max(w) (the fill
passes chunks, a v-th of a stage each), which is (sum(w) + (m v - 1) * max(w)) / v: the same
problem with m v micro-batches, each stage holding at least v layers (partition_chunks); a
stage's layers then go to its chunks so that its slowest chunk is as fast as it can be
(chunk_split).
"""

from __future__ import annotations

import heapq
import math


def stage_times(split: list[int], per_layer: list[float], extra: list[float]) -> list[float]:
    return [n * c + e for n, c, e in zip(split, per_layer, extra)]


def pipeline_cost(
    split: list[int], per_layer: list[float], extra: list[float], micro_batches: int
) -> float:
    """sum(w) + (m - 1) * max(w): the 1F1B time without communication."""
    times = stage_times(split, per_layer, extra)
    return sum(times) + (micro_batches - 1) * max(times)


def partition_layers(
    layers: int, per_layer: list[float], extra: list[float], cap: list[int], micro_batches: int
) -> list[int] | None:
    """The split of ``layers`` over the stages minimising pipeline_cost, or None if none fits the
    caps."""
    p = len(per_layer)
    caps = [min(c, layers - p + 1) for c in cap]
    if p > layers or min(caps) < 1 or sum(caps) < layers:
        return None
    cheapest = sorted(range(p), key=lambda s: per_layer[s])
    floor_sum = _least_sum(layers, per_layer, extra, caps, cheapest)
    # Candidate bounds in increasing order: a merge of every stage's w_s(1), w_s(2), ...
    limits = [0] * p
    heap = [(per_layer[s] + extra[s], s) for s in range(p)]
    heapq.heapify(heap)
    allowed, empty = 0, p
    best, best_cost = None, math.inf
    while heap:
        bound, s = heapq.heappop(heap)
        limits[s] += 1
        allowed += 1
        empty -= limits[s] == 1
        if limits[s] < caps[s]:
            heapq.heappush(heap, ((limits[s] + 1) * per_layer[s] + extra[s], s))
        if heap and heap[0][0] == bound:
            continue  # take every stage that reaches this bound before trying it
        if empty or allowed < layers:
            continue
        if (micro_batches - 1) * bound + floor_sum >= best_cost:
            break
        split = _fill(layers, limits, cheapest)
        cost = pipeline_cost(split, per_layer, extra, micro_batches)
        if cost < best_cost:
            best, best_cost = split, cost
    return best


def _fill(layers: int, limits: list[int], cheapest: list[int]) -> list[int]:
    """One layer per stage, the rest on the cheapest stages up to their limits."""
    split = [1] * len(limits)
    left = layers - len(limits)
    for s in cheapest:
        take = min(left, limits[s] - 1)
        split[s] += take
        left -= take
    return split


def _least_sum(
    layers: int, per_layer: list[float], extra: list[float], caps: list[int], cheapest: list[int]
) -> float:
    """The least sum(w) under the caps alone: a lower bound for every bound B."""
    return sum(stage_times(_fill(layers, caps, cheapest), per_layer, extra))


def partition_chunks(
    layers: int,
    per_layer: list[float],
    extra: list[float],
    cap: list[int],
    micro_batches: int,
    chunks: int,
) -> list[int] | None:
    """Layers per stage for interleaved 1F1B over ``chunks`` chunks a stage: partition_layers of
    the layers beyond one a chunk, those ``chunks`` - 1 layers a stage counted in its fixed time,
    over ``chunks`` x ``micro_batches`` micro-batches. None if none fits the caps."""
    if chunks == 1:
        return partition_layers(layers, per_layer, extra, cap, micro_batches)
    p, fixed = len(per_layer), chunks - 1
    split = partition_layers(
        layers - fixed * p,
        per_layer,
        [e + fixed * c for e, c in zip(extra, per_layer)],
        [c - fixed for c in cap],
        chunks * micro_batches,
    )
    return None if split is None else [n + fixed for n in split]


BELOW = 1e-9
"""A level this much under relaxed_bottleneck is under it despite rounding."""


def relaxed_bottleneck(layers: int, per_layer: list[float], extra: list[float]) -> float:
    """The least max(w) of any split with layers as real numbers of any sign: every stage then
    takes the same T, n_s c_s + e_s = T with sum(n_s) = layers, so T = (layers + sum(e_s /
    c_s)) / sum(1 / c_s). Whole layers, at least one a stage, and caps only raise it."""
    return (layers + sum(e / c for e, c in zip(extra, per_layer))) / sum(1 / c for c in per_layer)


def least_bottleneck(
    layers: int, per_layer: list[float], extra: list[float], cap: list[int]
) -> float | None:
    """The least max(w) of any split that partition_layers may choose (1 <= n <= cap a stage),
    or None where none fits the caps, as for partition_layers.

    Adding each layer to the stage that is fastest with it is exact for this min-max: the
    layers being alike on a stage, it takes the layers - p cheapest additions. Every addition
    that ends under relaxed_bottleneck is among them, so the stages start with those and the
    few left are added one by one."""
    p = len(per_layer)
    caps = [min(c, layers - p + 1) for c in cap]
    if p > layers or min(caps) < 1 or sum(caps) < layers:
        return None
    level = relaxed_bottleneck(layers, per_layer, extra) * (1 - BELOW)
    held = [max(1, min(c, math.floor((level - e) / w))) for c, w, e in zip(caps, per_layer, extra)]
    if sum(held) > layers:  # rounding at the level itself: start from one layer a stage
        held = [1] * p
    heap = [((n + 1) * w + e, s) for s, (n, w, e) in enumerate(zip(held, per_layer, extra))]
    heap = [(t, s) for t, s in heap if held[s] < caps[s]]
    heapq.heapify(heap)
    for _ in range(layers - sum(held)):
        _, s = heapq.heappop(heap)
        held[s] += 1
        if held[s] < caps[s]:
            heapq.heappush(heap, ((held[s] + 1) * per_layer[s] + extra[s], s))
    return max(stage_times(held, per_layer, extra))


def chunk_split(layers: int, chunks: int, per_layer: float, extra: list[float]) -> list[int]:
    """``layers`` over ``chunks`` chunks, at least one each, so that the slowest chunk (layers x
    per_layer + its extra: the embedding on a first chunk, the head on a last) is the fastest it
    can be: each layer goes to the chunk that is fastest with it (exact, the layers being alike)."""
    split = [1] * chunks
    heap = [((1 + 1) * per_layer + extra[c], c) for c in range(chunks)]
    heapq.heapify(heap)
    for _ in range(layers - chunks):
        _, c = heapq.heappop(heap)
        split[c] += 1
        heapq.heappush(heap, ((split[c] + 1) * per_layer + extra[c], c))
    return split
