"""The communicator's native backend choice."""

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
    """Each path on its own: the bytes this rank's communicator counts after each exchange."""
    import torch.distributed as dist

    from hethub.comm import Communicator

    comm = Communicator(VENDORS)
    tensor = torch.full((FLOATS,), float(rank + 1))
    seen = {}

    def record(what):
        seen[what] = dict(comm.bytes)
        comm.bytes = dict.fromkeys(comm.bytes, 0)

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
    nvidia = dist.new_group([0, 1])
    everyone = dist.group.WORLD
    if rank in (0, 1):
        summed = comm.all_reduce(tensor.clone(), (0, 1), nvidia)
        assert torch.equal(summed, torch.full((FLOATS,), 3.0))
    record("all-reduce native")
    summed = comm.all_reduce(tensor.clone(), (0, 1, 2, 3), everyone)
    assert torch.equal(summed, torch.full((FLOATS,), 10.0))
    record("all-reduce bridged")
    return seen


@pytest.mark.slow
def test_each_path_counts_exactly_the_bytes_it_moved():
    from hethub.comm import BRIDGE, NATIVE
    from hethub.runtime.spawn import run_ranks

    seen = run_ranks(_moves, 4, timeout_s=120, purpose="test")
    nothing = {NATIVE: 0, BRIDGE: 0}
    sent = FLOATS * 4
    # a message counts once at each end, on the path between the two vendors
    assert [s["p2p native"] for s in seen] == [{NATIVE: sent, BRIDGE: 0}] * 2 + [nothing] * 2
    assert [s["p2p bridged"] for s in seen] == [
        {NATIVE: 0, BRIDGE: sent},
        nothing,
        {NATIVE: 0, BRIDGE: sent},
        nothing,
    ]
    # a ring all-reduce moves 2 (n - 1) / n of the tensor out of each of its n ranks
    assert [s["all-reduce native"] for s in seen] == [{NATIVE: sent, BRIDGE: 0}] * 2 + [nothing] * 2
    assert [s["all-reduce bridged"] for s in seen] == [{NATIVE: 0, BRIDGE: 2 * 3 * sent // 4}] * 4
