"""Every process group a job needs: listed by a pure function, created in one place.

torch.distributed requires every rank to create every group, in the same order; a group created
on some ranks only, or in another order, hangs the job. So the list is a pure function of the
topology (the same on every rank) and ``create_groups`` alone calls ``dist.new_group``, walking
the list in order. The engine and the profiler receive the handles; neither creates a group.

Each group has the backend its ranks share: the native collective library of their devices
(nccl, which is RCCL on ROCm; hccl; xccl) when they are all accelerators of one vendor, gloo when
any of them runs on the CPU or they span vendors. The world group (gloo, made by
init_process_group) bootstraps the job and is the bridge between vendors.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from itertools import pairwise

import torch
import torch.distributed as dist

from hethub.comm import device_backend
from hethub.spec.cluster import ClusterSpec
from hethub.spec.model import ModelSpec
from hethub.spec.topology import Topology, parameter_holders

BRIDGE_BACKEND = "gloo"  # every machine has it; it moves host memory between any two ranks


class Role(StrEnum):
    """What a group is for."""

    WORLD = "world"  # every rank: bootstrap, barriers, the bridge between vendors
    TENSOR = "tensor"  # the TP ranks of one stage
    PIPELINE = "pipeline"  # the leaders of two neighbouring stages: activations and gradients
    GRAD_SYNC = "grad_sync"  # the leaders of every stage holding the same parameters (one vendor)
    SYNC_LOCAL = "sync_local"  # one vendor's part of a gradient-sync set that spans vendors
    SYNC_BRIDGE = "sync_bridge"  # the first rank of each vendor's part of such a set
    VENDOR = "vendor"  # every rank of one vendor, when the job spans several
    DATA = "data"  # a rank's data-parallel peers (Topology.data_parallel_peers), when used
    MEASURE = "measure"  # ranks the profiler times a collective among


@dataclass(frozen=True, slots=True)
class GroupSpec:
    role: Role
    ranks: tuple[int, ...]
    backend: str


def shared_backend(ranks: Iterable[int], vendors: Sequence[str], backends: Sequence[str]) -> str:
    """The backend of a group: its ranks' native backend when they share it and a vendor, else
    the bridge's."""
    ranks = list(ranks)
    if len({vendors[r] for r in ranks}) == 1 and len({backends[r] for r in ranks}) == 1:
        return backends[ranks[0]]
    return BRIDGE_BACKEND


def job_groups(
    topology: Topology,
    model: ModelSpec,
    vendors: Sequence[str],
    backends: Sequence[str],
    data_parallel: bool = False,
) -> tuple[GroupSpec, ...]:
    """Every group of the job, in the order every rank creates them. ``vendors[r]`` and
    ``backends[r]``: rank r's accelerator vendor and its device's native backend (gloo on a CPU);
    ``data_parallel``: also each rank's data-parallel peers (a sharded optimizer, an overlapped
    sync). Groups of one rank are left out: they never communicate."""
    world = tuple(range(topology.world_size))
    specs = [GroupSpec(Role.WORLD, world, BRIDGE_BACKEND)]

    def add(role: Role, ranks: tuple[int, ...]) -> None:
        spec = GroupSpec(role, ranks, shared_backend(ranks, vendors, backends))
        if len(ranks) > 1 and spec not in specs:  # two sync sets may share a vendor's part
            specs.append(spec)

    for ranks in topology.tp_groups:
        add(Role.TENSOR, ranks)
    for replica in sorted({r.replica for r in topology.ranks}):
        leaders = [
            topology.stage_ranks(replica, s)[0] for s in range(topology.replica_stages(replica))
        ]
        for sender, receiver in pairwise(leaders):
            add(Role.PIPELINE, (sender, receiver))
        if (
            len(topology.ranks[leaders[0]].chunks) > 1
        ):  # interleaved: the last stage feeds the first
            add(Role.PIPELINE, (leaders[-1], leaders[0]))
    # A sync set inside one vendor all-reduces natively; one that spans vendors reduces inside
    # each vendor natively and only the parts' first ranks cross the bridge (hierarchical).
    for leaders in sorted(set(parameter_holders(topology, model).values())):
        parts = vendor_parts(leaders, vendors)
        if len(parts) == 1:
            add(Role.GRAD_SYNC, leaders)
            continue
        for part in parts:
            add(Role.SYNC_LOCAL, part)
        add(Role.SYNC_BRIDGE, tuple(part[0] for part in parts))
    if data_parallel:
        for rank in world:
            add(Role.DATA, topology.data_parallel_peers(rank))
    if len(set(vendors)) > 1:
        for vendor in dict.fromkeys(vendors):
            add(Role.VENDOR, tuple(r for r in world if vendors[r] == vendor))
    return tuple(specs)


def vendor_parts(ranks: Sequence[int], vendors: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """``ranks`` split by vendor, each part sorted, the parts in the order of their first rank."""
    parts: dict[str, list[int]] = {}
    for rank in sorted(ranks):
        parts.setdefault(vendors[rank], []).append(rank)
    return tuple(tuple(part) for part in parts.values())


def blocks(world: int, size: int) -> list[tuple[int, ...]]:
    """Consecutive blocks of ``size`` ranks among ``world``, as many as fit: the profiler's
    stand-ins for a job's TP groups and collective groups."""
    return [tuple(range(start, start + size)) for start in range(0, world - size + 1, size)]


class ProcessGroups:
    """This rank's handles of the job's groups, looked up by role and ranks."""

    def __init__(self, handles: dict[tuple[Role, tuple[int, ...]], object]) -> None:
        self._handles = handles

    def get(self, role: Role, ranks: Sequence[int]):
        """The handle of that group (None for a single rank, which needs no group). KeyError for a
        group the job did not list, or one this rank is not in."""
        ranks = tuple(ranks)
        if len(ranks) == 1:
            return None
        return self._handles[(role, ranks)]


def create_groups(specs: Sequence[GroupSpec]) -> ProcessGroups:
    """Collective over the world group: create every listed group, in order (call it with the
    same list on every rank). The world group must exist already."""
    me = dist.get_rank()
    handles = {}
    for spec in specs:
        if spec.role is Role.WORLD:
            handle = dist.group.WORLD
        else:
            handle = dist.new_group(list(spec.ranks), backend=spec.backend)
        if me in spec.ranks:
            handles[(spec.role, spec.ranks)] = handle
    return ProcessGroups(handles)


def create_job_groups(
    topology: Topology,
    model: ModelSpec,
    cluster: ClusterSpec,
    device: torch.device,
    data_parallel: bool = False,
) -> ProcessGroups:
    """Collective over the world group: every group of the job of ``topology``, this rank
    running on ``device`` (``data_parallel`` as for job_groups). Every rank first learns every
    other's backend (each chose its own device on its own node), so that all of them list the
    same groups."""
    backends: list[str | None] = [None] * topology.world_size
    dist.all_gather_object(backends, device_backend(device))
    return create_groups(
        job_groups(topology, model, topology.vendors(cluster), backends, data_parallel)
    )
