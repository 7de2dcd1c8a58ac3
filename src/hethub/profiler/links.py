"""Measure gloo messages and collectives between processes of this machine, as the runtime's
gradient sync and pipeline messages run them: each time the plain mean of a series run back to
back, stalls included, and latency + bytes / bandwidth fitted to the sizes measured.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from hethub.errors import HethubError
from hethub.profiler.conditions import block_group, measured_here, timestamp
from hethub.profiles.machine import load_average
from hethub.profiles.types import COLLECTIVES, LinkProfile
from hethub.runtime.process_groups import Role
from hethub.runtime.spawn import run_ranks

LINK_SIZES = tuple(kib << 10 for kib in (4, 16, 64, 256, 512, 1024, 2048, 4096, 16384))
"""Message sizes measured (bytes): denser where a small model's gradient tensors are."""
LINK_REPEATS = 15
SMALL_MESSAGE = 1 << 20  # below it a message costs little to repeat, and its latency is noisy


def measure_links(
    device_name: str,
    ranks_list: Sequence[int] = (2,),
    sizes: Sequence[int] = LINK_SIZES,
    *,
    concurrent_ranks: int = 1,
    repeats: int = LINK_REPEATS,
    timeout_s: float = 600.0,
) -> LinkProfile:
    """Point-to-point, all-reduce, broadcast, all-gather and reduce-scatter speed between gloo
    processes of this machine: the time at each of ``sizes`` (bytes), and latency + bytes /
    bandwidth fitted to them.

    ``max(concurrent_ranks, max(ranks_list))`` processes take part: messages go between pairs of
    them, each collective of r ranks runs in as many disjoint groups of r as fit, all at once.
    """
    ranks_list = tuple(sorted(set(ranks_list)))
    if (
        not ranks_list
        or min(ranks_list) < 2
        or concurrent_ranks <= 0
        or not sizes
        or min(sizes) < 64
    ):
        raise HethubError(
            f"link profile: ranks {ranks_list} must be at least 2, concurrent ranks "
            f"{concurrent_ranks} positive, sizes at least 64 bytes"
        )
    world, load_before = max(concurrent_ranks, *ranks_list), load_average()
    per_rank = run_ranks(_link_rank, world, ranks_list, tuple(sizes), repeats, timeout_s=timeout_s)
    fits: dict[tuple[str, int], tuple[float, float]] = {}
    measured: dict[tuple[str, int], tuple[tuple[int, float], ...]] = {}
    for kind, ranks in {k for rank in per_rank for k in rank}:
        leaders = [rank[(kind, ranks)] for rank in per_rank if (kind, ranks) in rank]
        points = [
            (n, statistics.fmean(leader[n] for leader in leaders)) for n in sorted(set(sizes))
        ]
        fits[(kind, ranks)] = fit_latency_bandwidth(points)
        measured[(kind, ranks)] = non_decreasing(points)
    latency, bandwidth = fits[("p2p", 2)]
    return LinkProfile(
        device=device_name,
        concurrent_ranks=concurrent_ranks,
        p2p_latency_s=latency,
        p2p_bytes_per_s=bandwidth,
        **{kind: {r: fits[(kind, r)] for r in ranks_list} for kind in COLLECTIVES},
        measured_at=timestamp(),
        points=measured,
        measured_on=measured_here(torch.device("cpu"), load_before),
    )


def non_decreasing(points: Sequence[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """(bytes, seconds) by increasing size, each time at most that of any larger size: a message
    never takes longer than a larger one, so a small size's slower time is noise (a stall)."""
    out, fastest = [], float("inf")
    for n, t in sorted(points, reverse=True):
        fastest = min(fastest, t)
        out.append((n, fastest))
    return tuple(reversed(out))


def fit_latency_bandwidth(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(latency_s, bytes_per_s) of t = latency + bytes / bandwidth, least squares on the relative
    error (small messages count as much as large ones); the latency is never negative."""
    rows = [(1.0 / t, n / t) for n, t in points]  # each equation divided by its own time
    s11 = sum(a * a for a, _ in rows)
    s12 = sum(a * b for a, b in rows)
    s22 = sum(b * b for _, b in rows)
    y1, y2 = sum(a for a, _ in rows), sum(b for _, b in rows)  # right-hand side: t / t = 1
    det = s11 * s22 - s12 * s12
    latency, per_byte = (
        ((s22 * y1 - s12 * y2) / det, (s11 * y2 - s12 * y1) / det) if det > 0 else (-1.0, 0.0)
    )
    if per_byte <= 0:  # no size dependence measurable: a constant time
        per_byte = _FASTEST_PER_BYTE
        latency = max((y1 - per_byte * s12) / s11, 0.0)
    elif latency < 0:  # no latency measurable: bandwidth alone
        latency, per_byte = 0.0, y2 / s22
    return latency, 1.0 / per_byte


_FASTEST_PER_BYTE = 1e-15  # 1 PB/s: "too fast to measure" as a finite bandwidth


def _link_rank(
    rank: int, world: int, ranks_list: tuple[int, ...], sizes: tuple[int, ...], repeats: int
) -> dict[tuple[str, int], dict[int, float]]:
    """On one rank: mean seconds per size of each measurement this rank leads. Every group
    starts each size together and then repeats its operation back to back, as the runtime's
    gradient sync does."""
    out: dict[tuple[str, int], dict[int, float]] = {}
    pairs = world // 2 * 2
    for n in sizes:
        buffer = torch.zeros(n // 4)
        peer = rank ^ 1
        if rank >= pairs:
            op = _nothing
        elif rank % 2 == 0:  # ping-pong: half the round trip is one message

            def op(buffer=buffer, peer=peer):
                dist.send(buffer, peer)
                dist.recv(buffer, peer)
        else:

            def op(buffer=buffer, peer=peer):
                dist.recv(buffer, peer)
                dist.send(buffer, peer)

        seconds = _series(op, repeats_for_size(n, repeats)) / 2
        if rank < pairs and rank % 2 == 0:
            out.setdefault(("p2p", 2), {})[n] = seconds
    for r in ranks_list:
        group = block_group(world, r, Role.MEASURE)
        members = dist.get_process_group_ranks(group) if group is not None else None
        for kind in COLLECTIVES:
            for n in sizes:
                op = _collective(kind, n, r, group, members) if group is not None else _nothing
                seconds = _series(op, repeats_for_size(n, repeats))
                if members is not None and rank == members[0]:
                    out.setdefault((kind, r), {})[n] = seconds
    return out


def _series(op: Callable[[], None], repeats: int) -> float:
    """Every rank starts together, then ``op`` runs back to back: its mean seconds, stalls
    included. Not a trimmed mean: a gloo collective of a few hundred microseconds stalls for
    milliseconds every few dozen calls, and a gradient sync of ~75 tensors meets those stalls.
    (Measured here: 40 all-reduces of 768 bytes, 0.27 ms each without the extremes, 0.38 ms
    each over the whole series.)"""
    dist.barrier()
    op()  # warms up
    started = time.perf_counter()
    for _ in range(repeats):
        op()
    return (time.perf_counter() - started) / repeats


def repeats_for_size(nbytes: int, repeats: int) -> int:
    """How many times a message of ``nbytes`` is repeated: more below SMALL_MESSAGE, whose
    latency is noisy and which costs little to repeat."""
    return 8 * repeats if nbytes < SMALL_MESSAGE else repeats


def _collective(
    kind: str, nbytes: int, ranks: int, group, members: list[int]
) -> Callable[[], None]:
    if kind == "allgather":
        piece = torch.zeros(max(1, nbytes // 4 // ranks))
        pieces = [torch.empty_like(piece) for _ in range(ranks)]
        return lambda: dist.all_gather(pieces, piece, group=group)
    if kind == "reducescatter":
        # As a sharded optimizer's sync reduces a bucket (runtime.engine): the gradients copied
        # into one flat buffer, padded to a multiple of the ranks; each keeps its slice of the sum.
        flat = torch.zeros(max(1, nbytes // 4 // ranks) * ranks)
        mine = torch.empty(flat.numel() // ranks)
        return lambda: dist.reduce_scatter_single(mine, torch.cat([flat]), group=group)
    tensor = torch.zeros(nbytes // 4)
    if kind == "broadcast":
        return lambda: dist.broadcast(tensor, members[0], group=group)

    def bucket_allreduce() -> None:
        # As the runtime's gradient sync reduces a bucket: the gradients copied into one flat
        # buffer, reduced, copied back. The copies cost a quarter of a 14 MB bucket's sync here.
        flat = torch.cat([tensor.view(-1)])
        dist.all_reduce(flat, group=group)
        tensor.copy_(flat)

    return bucket_allreduce


def _nothing() -> None:
    return None
