"""Gradient buckets: the runtime sums a stage's gradients over its replicas in a few large flat
buffers, not tensor by tensor, and the predictor prices the same buckets.

Why: a gloo collective costs a fraction of a millisecond however small its tensor, and a stage
has tens of small tensors (norms, biases): measured here, the 75 all-reduces of an 8-layer stage
of the 3.6M-parameter local model took ~100 ms, where one all-reduce of their total size takes a
fraction of that. Like torch DDP, gradients go in buckets of at most BUCKET_BYTES, which bounds
the extra copy of the gradients a bucket holds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hethub.spec.model import ModelSpec
from hethub.spec.parameters import parameter_table, stage_parameters
from hethub.spec.plan import MAIN_GRAD_BYTES
from hethub.spec.topology import Topology, parameter_holders

BUCKET_BYTES = 25 << 20
"""At most this many bytes in one bucket (torch DDP's default bucket_cap_mb); a tensor larger
than that gets a bucket of its own."""


def bucket_bounds(sizes: Sequence[int], cap: int = BUCKET_BYTES) -> list[tuple[int, int]]:
    """(start, stop) index ranges of consecutive ``sizes`` (bytes), each adding up to at most
    ``cap``."""
    bounds, start, filled = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and filled + size > cap:
            bounds.append((start, i))
            start, filled = i, 0
        filled += size
    if start < len(sizes):
        bounds.append((start, len(sizes)))
    return bounds


@dataclass(frozen=True, slots=True)
class SyncBucket:
    """Gradients one rank sums as one flat buffer with the other stages holding them."""

    holders: tuple[int, ...]
    """The leaders (first TP rank) of the stages holding its parameters, sorted."""
    names: tuple[str, ...]
    """Its parameters' full-model names, in the buffer's order."""
    direct: bool
    """Held by exactly the stages of this rank's data-parallel peers, in a plan that gives the
    peers a group (a sharded optimizer, an overlapped sync): summed among the peers, each TP rank
    its own shards, in one collective; else gathered in the TP group and summed by the leaders."""


def rank_buckets(
    topology: Topology,
    model: ModelSpec,
    rank: int,
    *,
    peers_have_a_group: bool,
    cap: int = BUCKET_BYTES,
) -> tuple[SyncBucket, ...]:
    """The gradient sync's buckets of ``rank``, in the order every rank runs them: its
    parameters held by more than one stage (topology.parameter_holders), in full-model name
    order, grouped by their holders (groups in the order of their first name, so collectives of
    different groups interleave the same way everywhere) and cut at ``cap`` bytes of each
    tensor's full fp32 gradient, whatever the TP degree. The runtime syncs these buckets and the
    predictor prices them."""
    me = topology.ranks[rank]
    holders = parameter_holders(topology, model)
    names = sorted(
        name
        for chunk in me.chunks
        for name in stage_parameters(
            model, chunk.first_layer, chunk.layers, is_first=chunk.is_first, is_last=chunk.is_last
        )
    )
    held: dict[tuple[int, ...], list[str]] = {}
    for name in names:
        if len(holders[name]) > 1:
            held.setdefault(holders[name], []).append(name)
    peer_leaders = {
        topology.stage_ranks(topology.ranks[q].replica, me.stage)[0]
        for q in topology.data_parallel_peers(rank)
    }
    table = parameter_table(model)
    buckets = []
    for leaders, group in held.items():
        direct = peers_have_a_group and set(leaders) == peer_leaders
        full_bytes = [math.prod(table[name].shape) * MAIN_GRAD_BYTES for name in group]
        buckets += [
            SyncBucket(leaders, tuple(group[start:stop]), direct)
            for start, stop in bucket_bounds(full_bytes, cap)
        ]
    return tuple(buckets)
