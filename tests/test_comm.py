"""The communicator: its native backend choice, and every message and collective it runs, with
its values and exactly the bytes it counts on each path."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hethub.comm import native_backend


@pytest.mark.skipif(
    torch.cuda.is_available() or importlib.util.find_spec("torch_npu") is not None,
    reason="this machine has an accelerator with a native library",
)
def test_a_machine_without_accelerators_talks_gloo():
    assert native_backend() == "gloo"


VENDORS = ["nvidia", "nvidia", "amd", "amd"]
FLOATS = 1000  # 4,000 bytes of fp32


def _moves(rank, world):
    """Each path and collective on its own: the bytes this rank's communicator counts after
    each, and that each gave the right values."""
    import torch.distributed as dist

    from hethub.comm import Communicator, Group

    comm = Communicator(VENDORS)
    tensor = torch.full((FLOATS,), float(rank + 1))
    seen = {}

    def record(what):
        seen[what] = dict(comm.bytes)
        comm.bytes = dict.fromkeys(comm.bytes, 0)

    def group(ranks, handle):  # as process_groups.create_groups holds them
        return Group(ranks, handle if rank in ranks else None)

    # every rank creates every group, in one order
    nvidia = group((0, 1), dist.new_group([0, 1]))
    amd = group((2, 3), dist.new_group([2, 3]))
    bridge = group((0, 2), dist.new_group([0, 2]))
    everyone = Group((0, 1, 2, 3), dist.group.WORLD)
    mine = nvidia if rank in nvidia.ranks else amd

    # point to point: 0 -> 1 inside nvidia, 0 -> 2 across to amd
    for peer_pair, what in (((0, 1), "p2p native"), ((0, 2), "p2p bridged")):
        sender, receiver = peer_pair
        if rank == sender:
            comm.isend(tensor, receiver).wait()
        elif rank == receiver:
            buffer = torch.empty(FLOATS)
            comm.recv(buffer, sender)
            assert torch.equal(buffer, torch.full((FLOATS,), float(sender + 1)))
        record(what)
    if rank in nvidia.ranks:
        summed = comm.all_reduce(tensor.clone(), nvidia)
        assert torch.equal(summed, torch.full((FLOATS,), 3.0))
    record("all-reduce native")
    summed = comm.all_reduce(tensor.clone(), everyone)
    assert torch.equal(summed, torch.full((FLOATS,), 10.0))
    record("all-reduce bridged")
    summed = comm.start_all_reduce(tensor.clone(), mine).wait()
    assert torch.equal(summed, torch.full((FLOATS,), 3.0 if rank < 2 else 7.0))
    record("all-reduce started")
    # each rank's slice of the sum over its vendor: [1 2 3 ...] + [2 3 4 ...] on nvidia
    ramp = torch.arange(FLOATS, dtype=torch.float32) + rank + 1
    mine_of_sum = comm.start_reduce_scatter(ramp, mine).wait()
    first, half = 2 * (rank // 2), FLOATS // 2
    expected = (torch.arange(FLOATS, dtype=torch.float32) * 2 + 2 * first + 3).chunk(2)
    assert torch.equal(mine_of_sum, expected[rank % 2])
    assert mine_of_sum.numel() == half
    record("reduce-scatter native")
    # in place (a sharded optimizer's buffers): the sum lands in this rank's own slice of the
    # input, and the gather fills the rest of it around that slice
    ramp = torch.arange(FLOATS, dtype=torch.float32) + rank + 1
    own = ramp[(rank % 2) * half : (rank % 2 + 1) * half]
    comm.start_reduce_scatter(ramp, mine, own).wait()
    assert torch.equal(own, expected[rank % 2])
    record("reduce-scatter in place")
    comm.all_gather_into(ramp, own, mine)
    assert torch.equal(ramp, torch.cat(expected))
    record("all-gather in place")
    whole = comm.all_gather(tensor, mine)
    assert torch.equal(whole, torch.cat([torch.full((FLOATS,), float(r + 1)) for r in mine.ranks]))
    record("all-gather native")
    rows = comm.all_gather(tensor.view(2, FLOATS // 2), mine, dim=1)
    assert rows.shape == (2, FLOATS) and torch.equal(
        rows[:, half:], torch.full((2, half), 2.0 + first)
    )
    record("all-gather native, along dim 1")
    shared = comm.broadcast(tensor.clone(), 3, everyone)
    assert torch.equal(shared, torch.full((FLOATS,), 4.0))
    record("broadcast bridged")
    summed = comm.hierarchical_all_reduce(tensor.clone(), mine, bridge)
    assert torch.equal(summed, torch.full((FLOATS,), 10.0))
    record("hierarchical all-reduce")
    with comm.not_counted():
        comm.all_reduce(tensor.clone(), everyone)
        comm.all_gather(tensor, mine)
    record("not counted")
    return seen


@pytest.mark.slow
def test_each_path_counts_exactly_the_bytes_it_moved():
    from hethub.comm import BRIDGE, NATIVE
    from hethub.runtime.spawn import run_ranks

    seen = run_ranks(_moves, 4, timeout_s=120, purpose="test")
    nothing = {NATIVE: 0, BRIDGE: 0}
    sent = FLOATS * 4

    def native(n):
        return {NATIVE: n, BRIDGE: 0}

    # a message counts once at each end, on the path between the two vendors
    assert [s["p2p native"] for s in seen] == [native(sent)] * 2 + [nothing] * 2
    assert [s["p2p bridged"] for s in seen] == [
        {NATIVE: 0, BRIDGE: sent},
        nothing,
        {NATIVE: 0, BRIDGE: sent},
        nothing,
    ]
    # a ring all-reduce moves 2 (n - 1) / n of the tensor out of each of its n ranks
    assert [s["all-reduce native"] for s in seen] == [native(sent)] * 2 + [nothing] * 2
    assert [s["all-reduce bridged"] for s in seen] == [{NATIVE: 0, BRIDGE: 2 * 3 * sent // 4}] * 4
    assert [s["all-reduce started"] for s in seen] == [native(sent)] * 4
    # a reduce-scatter over 2 ranks: (n - 1) / n of the input out of each; an all-gather the
    # n - 1 other pieces in, whatever the dim
    assert [s["reduce-scatter native"] for s in seen] == [native(sent // 2)] * 4
    assert [s["reduce-scatter in place"] for s in seen] == [native(sent // 2)] * 4
    assert [s["all-gather in place"] for s in seen] == [native(sent // 2)] * 4
    assert [s["all-gather native"] for s in seen] == [native(sent)] * 4
    assert [s["all-gather native, along dim 1"] for s in seen] == [native(sent)] * 4
    # a broadcast: the tensor once on every rank
    assert [s["broadcast bridged"] for s in seen] == [{NATIVE: 0, BRIDGE: sent}] * 4
    # the funnel across vendors: a reduce to the part's first rank ((2 - 1) / 2 of it) and a
    # broadcast back (all of it, as any broadcast), natively; only the two first ranks cross
    # the bridge, each with 2 (2 - 1) / 2 of it
    assert [s["hierarchical all-reduce"] for s in seen] == [
        {NATIVE: 3 * sent // 2, BRIDGE: sent},
        native(3 * sent // 2),
        {NATIVE: 3 * sent // 2, BRIDGE: sent},
        native(3 * sent // 2),
    ]
    assert [s["not counted"] for s in seen] == [nothing] * 4
