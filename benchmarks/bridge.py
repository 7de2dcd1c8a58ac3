"""hethub's all-reduce across vendors, the old funnel and the sliced one, against a flat gloo
all-reduce of the same tensor over the same ranks: 2 emulated vendors of 2 and of 4 ranks each
(a Communicator told the first half's vendor differs from the second's), on this CPU, at 1, 16
and 256 MB of fp32. For each: the wall time (the slowest rank's, the best of the repeats), the
bytes per path summed over ranks, and the busiest rank's bytes per path.

Usage: python benchmarks/bridge.py [--repeats N] [--sizes-mb 1,16,256] [--ranks 2,4]
Targets (issue 38): the busiest rank's bridge bytes at most 1.3 / k of the funnel's, for k ranks
a vendor; at 256 MB over 2x4 ranks the sliced all-reduce at most 1.2x the flat all-reduce.

It first measures what BRIDGE_CHUNK_BYTES was chosen by: a 2-rank gloo all-reduce's cost
beyond its bytes (at 4 KiB) against its time at one chunk.

Each repeat runs the three in turn on the same ranks (the order rotated each repeat), so that
all see the same moments of a shared machine. Each process uses one thread.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from hethub.comm import BRIDGE, BRIDGE_CHUNK_BYTES, NATIVE, Communicator, Group, SlicedBridge
from hethub.runtime.spawn import run_ranks
from hethub.spec.slices import bridge_slices

MB = 1 << 20
WAYS = ("flat", "funnel", "sliced")


def _chunk_cost(rank: int, world: int, repeats: int = 20) -> tuple[float, float]:
    """The best time of a gloo all-reduce over the world at 4 KiB and at one bridge chunk."""
    best = []
    for nbytes in (4096, BRIDGE_CHUNK_BYTES):
        tensor = torch.ones(nbytes // 4)
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            times.append(time.perf_counter() - start)
        best.append(min(times))
    return best[0], best[1]


def _bench(rank: int, world: int, sizes_mb: list[int], repeats: int) -> dict:
    """On each rank: every way at every size, its best time (this rank's) and its bytes."""
    per_vendor = world // 2
    parts = (tuple(range(per_vendor)), tuple(range(per_vendor, world)))
    comm = Communicator(["a"] * per_vendor + ["b"] * per_vendor)
    # every rank creates every group, in one order (as process_groups.create_groups)
    handles = {part: dist.new_group(list(part)) for part in parts}
    funnel_handle = dist.new_group([part[0] for part in parts])
    slice_groups = []
    for cut in bridge_slices(parts):
        handle = dist.new_group(list(cut.ranks))
        slice_groups.append(Group(cut.ranks, handle if rank in cut.ranks else None))
    local_ranks = parts[rank // per_vendor]
    local = Group(local_ranks, handles[local_ranks])
    first = tuple(part[0] for part in parts)
    funnel = Group(first, funnel_handle if rank in first else None)
    sliced = SlicedBridge(parts, tuple(slice_groups))
    everyone = Group(tuple(range(world)), dist.group.WORLD)
    run = {
        "flat": lambda t: comm.all_reduce(t, everyone),
        "funnel": lambda t: comm.hierarchical_all_reduce(t, local, funnel),
        "sliced": lambda t: comm.sliced_all_reduce(t, local, sliced),
    }
    out = {}
    for size_mb in sizes_mb:
        tensor = torch.full((size_mb * MB // 4,), float(rank + 1))
        expected = world * (world + 1) / 2
        best = dict.fromkeys(WAYS, float("inf"))
        moved = {}
        for repeat in range(repeats + 1):  # the first a warm-up
            order = WAYS[repeat % 3 :] + WAYS[: repeat % 3]
            for way in order:
                tensor.fill_(float(rank + 1))
                comm.bytes = dict.fromkeys(comm.bytes, 0)
                dist.barrier()
                start = time.perf_counter()
                run[way](tensor)
                elapsed = time.perf_counter() - start
                assert tensor[0].item() == expected and tensor[-1].item() == expected, way
                moved[way] = dict(comm.bytes)
                if repeat:
                    best[way] = min(best[way], elapsed)
        out[size_mb] = {way: (best[way], moved[way]) for way in WAYS}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sizes-mb", default="1,16,256")
    parser.add_argument("--ranks", default="2,4", help="ranks a vendor, comma-separated")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes_mb.split(",")]
    small, chunk = max(run_ranks(_chunk_cost, 2, timeout_s=600, purpose="bridge"))
    print(
        f"gloo all-reduce, 2 ranks: {small * 1e3:.3f} ms at 4 KiB, {chunk * 1e3:.2f} ms at a "
        f"{BRIDGE_CHUNK_BYTES / MB:g} MiB chunk ({BRIDGE_CHUNK_BYTES / chunk / 1e9:.2f} GB/s): "
        f"the per-message cost is {small / chunk:.1%} of a chunk's time"
    )
    print(
        f"{'vendors':>7} {'MB':>4} {'way':>6} {'time s':>8} {'x flat':>6} {'x funnel':>8} "
        f"{'native MB':>9} {'bridge MB':>9} {'busiest native':>14} {'busiest bridge':>14}"
    )
    for k in (int(r) for r in args.ranks.split(",")):
        ranks = run_ranks(_bench, 2 * k, sizes, args.repeats, timeout_s=3600, purpose="bridge")
        for size in sizes:
            # the slowest rank's time is the collective's; busiest: the most any rank sent
            rows = {
                way: (
                    max(r[size][way][0] for r in ranks),
                    {p: sum(r[size][way][1][p] for r in ranks) for p in (NATIVE, BRIDGE)},
                    {p: max(r[size][way][1][p] for r in ranks) for p in (NATIVE, BRIDGE)},
                )
                for way in WAYS
            }
            for way, (seconds, total, busiest) in rows.items():
                print(
                    f"{f'2x{k}':>7} {size:>4} {way:>6} {seconds:>8.3f} "
                    f"{seconds / rows['flat'][0]:>6.2f} {seconds / rows['funnel'][0]:>8.2f} "
                    f"{total[NATIVE] / MB:>9.1f} {total[BRIDGE] / MB:>9.1f} "
                    f"{busiest[NATIVE] / MB:>14.1f} {busiest[BRIDGE] / MB:>14.1f}"
                )
            ratio = rows["sliced"][2][BRIDGE] / rows["funnel"][2][BRIDGE]
            print(
                f"        busiest rank's bridge bytes, sliced / funnel: {ratio:.3f} "
                f"(target <= {1.3 / k:.3f})"
            )


if __name__ == "__main__":
    main()
