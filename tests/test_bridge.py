"""The bridge between vendors sliced over every holder: how a tensor is cut (a pure function),
the staging pool, and the sliced all-reduce on real gloo ranks, its sum and exactly the bytes
each rank sends on each path."""

from __future__ import annotations

import pytest
import torch

from hethub.comm import StagingPool
from hethub.spec.slices import (
    BridgeSlice,
    SyncClass,
    bridge_slices,
    padded_length,
    slice_units,
    sync_classes,
)


def test_equal_vendors_pair_each_holder_with_its_peer():
    assert bridge_slices([(0, 1), (2, 3)]) == (
        BridgeSlice(0, 1, (0, 2)),
        BridgeSlice(1, 2, (1, 3)),
    )


def test_unequal_vendors_cut_at_every_vendors_boundaries():
    # 3 and 2 holders: units of 1/6; each rank owns only slices inside its own piece
    assert bridge_slices([(0, 1, 2), (3, 4)]) == (
        BridgeSlice(0, 2, (0, 3)),
        BridgeSlice(2, 3, (1, 3)),
        BridgeSlice(3, 4, (1, 4)),
        BridgeSlice(4, 6, (2, 4)),
    )
    # a vendor of one holder: it carries the whole tensor, the other's two a half each
    assert bridge_slices([(0, 1), (2,)]) == (BridgeSlice(0, 1, (0, 2)), BridgeSlice(1, 2, (1, 2)))
    # three vendors: every slice has one owner on each
    assert [s.ranks for s in bridge_slices([(0, 1), (2,), (3, 4, 5, 6)])] == [
        (0, 2, 3),
        (0, 2, 4),
        (1, 2, 5),
        (1, 2, 6),
    ]


def test_no_rank_owns_more_than_its_vendors_share():
    parts = [(0, 1, 2, 3), (4, 5, 6), (7, 8)]
    units = slice_units(parts)
    assert units == 12
    owned = {}
    for cut in bridge_slices(parts):
        for rank in cut.ranks:
            owned[rank] = owned.get(rank, 0) + cut.stop - cut.start
    assert owned == {r: units // len(p) for p in parts for r in p}
    assert padded_length(1000, parts) == 1008 and padded_length(1008, parts) == 1008


def test_the_staging_pool_lends_a_buffer_again_instead_of_making_one():
    pool = StagingPool(pin=False)
    first = pool.take(100, torch.float32)
    pool.give_back(first)
    again = pool.take(80, torch.float32)  # fits in the first: lent again
    assert again.data_ptr() == first.data_ptr() and again.numel() == 80 and pool.made == 1
    # while one is lent (or its last use unfinished), another is made
    busy = [False]
    pool.give_back(again, lambda: busy[0])
    other = pool.take(80, torch.float32)
    assert other.data_ptr() != first.data_ptr() and pool.made == 2
    busy[0] = True  # the first's use finished: it is free again
    assert pool.take(100, torch.float32).data_ptr() == first.data_ptr() and pool.made == 2
    pool.give_back(other)
    grown = pool.take(500, torch.float32)  # a free one too small grows: still two buffers
    assert grown.numel() == 500 and pool.made == 3 and len(pool._buffers) == 2
    with pytest.raises(ValueError, match="did not lend"):
        pool.give_back(torch.empty(3))


LAYOUTS = {  # name: each vendor's ranks, among 5
    "2 and 2": ((0, 1), (2, 3)),
    "3 and 2": ((0, 1, 2), (3, 4)),
    "2 and 1": ((0, 1), (2,)),
}
SIZES = (1200, 1001)  # elements: one a multiple of every layout's units, one not (padded)


def _values(rank, numel):
    """Rank ``rank``'s tensor: small integers, so that any order of summing them is exact."""
    return (torch.arange(numel, dtype=torch.float32) * (rank + 1)) % 97 - rank


def _sliced(rank, world):
    """Every layout, every size, at once and started-then-finished: the sums, and this rank's
    bytes per path of each."""
    import torch.distributed as dist

    from hethub.comm import Communicator, Group, SlicedBridge
    from hethub.spec.slices import bridge_slices

    out = {}
    for name, parts in LAYOUTS.items():
        vendors = [f"v{i}" for i, part in enumerate(parts) for _ in part]
        vendors += ["idle"] * (world - len(vendors))
        comm = Communicator(vendors)
        # every rank creates every group, in one order, as process_groups.create_groups does
        handles = {part: dist.new_group(list(part)) for part in parts}
        slices = []
        for cut in bridge_slices(parts):
            handle = dist.new_group(list(cut.ranks))
            slices.append(Group(cut.ranks, handle if rank in cut.ranks else None))
        bridge = SlicedBridge(parts, tuple(slices))
        if rank not in {r for part in parts for r in part}:
            continue
        local = next(part for part in parts if rank in part)
        local = Group(local, handles[local] if len(local) > 1 else None)
        holders = [r for part in parts for r in part]
        for numel in SIZES:
            comm.bytes = dict.fromkeys(comm.bytes, 0)
            summed = comm.sliced_all_reduce(_values(rank, numel), local, bridge)
            expected = sum(_values(r, numel) for r in holders)
            assert torch.equal(summed, expected), (name, numel)
            out[(name, numel)] = dict(comm.bytes)
            started = comm.start_sliced_all_reduce(_values(rank, numel), local, bridge)
            assert torch.equal(comm.finish_sliced_all_reduce(started), expected)
    return out


@pytest.mark.slow
def test_the_sliced_all_reduce_sums_and_each_rank_sends_its_share():
    from hethub.comm import BRIDGE, NATIVE
    from hethub.runtime.spawn import run_ranks

    seen = run_ranks(_sliced, 5, timeout_s=180, purpose="test")
    for name, parts in LAYOUTS.items():
        units = slice_units(parts)
        for numel in SIZES:
            padded = padded_length(numel, parts)
            unit_bytes = padded // units * 4
            for part in parts:
                k = len(part)
                for rank in part:
                    # the ring formula: a reduce-scatter and an all-gather inside the vendor,
                    # (k - 1) / k of the padded tensor each; over the bridge, each owned slice
                    # all-reduced among one rank per vendor, 2 (m - 1) / m of it
                    native = 2 * (k - 1) * padded * 4 // k
                    m = len(parts)
                    bridge = sum(
                        2 * (m - 1) * (cut.stop - cut.start) * unit_bytes // m
                        for cut in bridge_slices(parts)
                        if rank in cut.ranks
                    )
                    assert seen[rank][(name, numel)] == {NATIVE: native, BRIDGE: bridge}, (
                        name,
                        numel,
                        rank,
                    )
            # the busiest rank sends 1/k of the funnel's bridge bytes (the whole tensor out of
            # the first rank of each vendor), for the fewest holders k on any vendor
            busiest = max(seen[r][(name, numel)][BRIDGE] for part in parts for r in part)
            funnel = 2 * (len(parts) - 1) * numel * 4 // len(parts)
            fewest = min(len(part) for part in parts)
            assert busiest <= 1.01 * funnel / fewest


def test_a_bucket_is_summed_in_classes_one_tp_rank_of_each_holder_stage():
    # like degrees: TP rank i of every stage sums its own shard with its peers
    assert sync_classes([(0, 1), (4, 5)]) == (
        SyncClass(0, 1, 2, (0, 4)),
        SyncClass(1, 2, 2, (1, 5)),
    )
    # TP 2 beside TP 1: the TP-1 rank holds both halves, and sums each with its holder
    assert [c.ranks for c in sync_classes([(0, 1), (2,)])] == [(0, 2), (1, 2)]
    # TP 2 beside TP 4: each half of the TP-2 stage meets the two quarters it covers
    assert [(c.start, c.stop, c.ranks) for c in sync_classes([(0, 1), (2, 3, 4, 5)])] == [
        (0, 1, (0, 2)),
        (1, 2, (0, 3)),
        (2, 3, (1, 4)),
        (3, 4, (1, 5)),
    ]
    # TP 1 everywhere: the one class is the stage leaders', as the funnel's sum had it
    assert sync_classes([(0,), (3,), (7,)]) == (SyncClass(0, 1, 1, (0, 3, 7)),)
    # every rank of every stage is in a class: each gets the sum of what it holds
    stages = [(0, 1, 2), (3, 4), (5,)]
    covered = {r for c in sync_classes(stages) for r in c.ranks}
    assert covered == {r for stage in stages for r in stage}
