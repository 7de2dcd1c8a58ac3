"""Every process group a job needs: listed by a pure function, created in one place.

torch.distributed requires every rank to create every group, in the same order; a group created
on some ranks only, or in another order, hangs the job. So the list is a pure function of the
topology (the same on every rank) and ``create_groups`` alone calls ``dist.new_group``, walking
the list in order. The engine and the profiler receive the handles; neither creates a group.

A rank holds its groups as named fields (``RankGroups``: ``groups.tp``, ``groups.pipeline_next``,
``groups.grad_sync[holders]``), as Megatron-core's ProcessGroupCollection does, built once by
``rank_groups``; nobody looks a group up by rebuilding its ranks.

Each group has the backend its ranks share: the native collective library of their devices
(nccl, which is RCCL on ROCm; hccl; xccl) when they are all accelerators of one vendor, gloo when
any of them runs on the CPU or they span vendors. The world group (gloo, made by
init_process_group) bootstraps the job and is the bridge between vendors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import pairwise

import torch
import torch.distributed as dist

from hethub.comm import Group, SlicedBridge, device_backend
from hethub.spec.cluster import ClusterSpec
from hethub.spec.model import ModelSpec
from hethub.spec.slices import SyncClass, bridge_slices, sync_classes, vendor_parts
from hethub.spec.topology import Topology, parameter_holders

BRIDGE_BACKEND = "gloo"  # every machine has it; it moves host memory between any two ranks


class Role(StrEnum):
    """What a group is for."""

    WORLD = "world"  # every rank: bootstrap, barriers, the bridge between vendors
    TENSOR = "tensor"  # the TP ranks of one stage
    PIPELINE = "pipeline"  # the TP ranks of two neighbouring stages: activations and gradients
    GRAD_SYNC = "grad_sync"  # a class of a bucket's holders: a TP rank of each stage (one vendor)
    SYNC_LOCAL = "sync_local"  # one vendor's part of a gradient-sync class that spans vendors
    SYNC_BRIDGE = "sync_bridge"  # a slice's owner on each vendor's part of such a set
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
    listed = set(specs)  # a set beside the list: thousands of groups at scale

    def add(role: Role, ranks: tuple[int, ...]) -> None:
        spec = GroupSpec(role, ranks, shared_backend(ranks, vendors, backends))
        if len(ranks) > 1 and spec not in listed:  # sync sets may share a part or a slice
            specs.append(spec)
            listed.add(spec)

    for ranks in topology.tp_groups:
        add(Role.TENSOR, ranks)
    # Each ordered pair of neighbouring stages: both stages' TP ranks, the sender's first
    # (runtime.p2p: each TP rank sends its run of a message to the other stage's ranks).
    for replica in sorted({r.replica for r in topology.ranks}):
        stages = [topology.stage_ranks(replica, s) for s in range(topology.replica_stages(replica))]
        v_shaped = runs_a_v(topology, replica)
        for sender, receiver in pairwise(stages):
            add(Role.PIPELINE, sender + receiver)
            if v_shaped:  # the V's way back: chunk 1's activations from the stage after
                add(Role.PIPELINE, receiver + sender)
        if (
            len(topology.ranks[stages[0][0]].chunks) > 1 and not v_shaped
        ):  # interleaved: the last stage feeds the first
            add(Role.PIPELINE, stages[-1] + stages[0])
    # A bucket's holder stages sum it in classes, one TP rank of each stage in a class
    # (spec.slices.sync_classes). A class inside one vendor all-reduces natively; one that spans
    # vendors reduce-scatters inside each vendor natively and each slice crosses the bridge
    # among its owners, one per vendor: as many bridge groups as slices, made once for the job.
    for leaders in sorted(set(parameter_holders(topology, model).values())):
        if len(leaders) == 1:
            continue
        for share in sync_classes([topology.tp_group(leader) for leader in leaders]):
            parts = vendor_parts(share.ranks, vendors)
            if len(parts) == 1:
                add(Role.GRAD_SYNC, parts[0])
                continue
            for part in parts:
                add(Role.SYNC_LOCAL, part)
            for cut in bridge_slices(parts):
                add(Role.SYNC_BRIDGE, cut.ranks)
    if data_parallel:
        for rank in world:
            add(Role.DATA, topology.data_parallel_peers(rank))
    if len(set(vendors)) > 1:
        for vendor in dict.fromkeys(vendors):
            add(Role.VENDOR, tuple(r for r in world if vendors[r] == vendor))
    return tuple(specs)


def runs_a_v(topology: Topology, replica: int) -> bool:
    """Whether ``replica``'s stages hold their chunks in ZBV's V (spec.schedules.model_chunk):
    its first stage holds the model's last chunk too. Interleaving puts that on the last stage,
    so a V is told apart from the chunks alone, the same on every rank."""
    first = topology.ranks[topology.stage_ranks(replica, 0)[0]]
    return topology.replica_stages(replica) > 1 and first.chunks[-1].is_last


def blocks(world: int, size: int) -> list[tuple[int, ...]]:
    """Consecutive blocks of ``size`` ranks among ``world``, as many as fit: the profiler's
    stand-ins for a job's TP groups and collective groups."""
    return [tuple(range(start, start + size)) for start in range(0, world - size + 1, size)]


@dataclass(frozen=True, slots=True)
class SyncGroups:
    """A rank's groups for summing its share of a bucket with the other ranks of its class
    (spec.slices.sync_classes: one TP rank of every stage holding the bucket)."""

    local: Group
    """The class's ranks of this rank's vendor: the whole class when it has one vendor."""
    bridge: SlicedBridge | None = None
    """When the class spans vendors (None when it has one): each vendor's part and the groups
    its slices cross the bridge in (comm.Communicator.sliced_all_reduce), each group's handle
    on its own ranks only."""


@dataclass(frozen=True, slots=True)
class ClassSync:
    """One class of a bucket's sum that a rank is in: which share it sums, and with whom."""

    share: SyncClass
    groups: SyncGroups


@dataclass(frozen=True, slots=True, kw_only=True)
class RankGroups:
    """One rank's groups of the job, each named by what it is for (Megatron-core's
    ProcessGroupCollection). A field is None where this rank has no such group."""

    world: Group
    """Every rank: bootstrap, barriers, the step's loss report."""
    tp: Group
    """The TP ranks of this rank's stage, the stage leader first (no handle at TP 1)."""
    pipeline_prev: Group | None = None
    """With a previous stage (interleaved: the last stage precedes the first): that stage's TP
    ranks then this stage's, which carries activations in and their gradients back out."""
    pipeline_next: Group | None = None
    """With a next stage: this stage's TP ranks then that stage's."""
    pipeline_return_prev: Group | None = None
    """Under ZBV's V, with a stage after it: that stage's TP ranks then this stage's, which
    carries the V's way back (chunk 1: activations in, their gradients out)."""
    pipeline_return_next: Group | None = None
    """Under ZBV's V, with a stage before it: this stage's TP ranks then that stage's, chunk
    1's activations out and their gradients in."""
    data: Group | None = None
    """This rank's data-parallel peers (Topology.data_parallel_peers), when the plan gives them a
    group of their own (a sharded optimizer, an overlapped sync) and there are several."""
    grad_sync: Mapping[tuple[int, ...], tuple[ClassSync, ...]] = field(default_factory=dict)
    """For each holder set this rank's stage is in (the leaders of the stages holding a
    spec.buckets bucket), the classes this rank sums its share of the bucket in and their
    groups."""
    vendor: Group | None = None
    """Every rank of this rank's vendor, when the job spans several."""

    @property
    def leader(self) -> int:
        """The global rank leading this rank's stage: its first TP rank."""
        return self.tp.ranks[0]


def rank_groups(
    topology: Topology,
    model: ModelSpec,
    vendors: Sequence[str],
    rank: int,
    *,
    data_parallel: bool = False,
    created: Mapping[tuple[Role, tuple[int, ...]], Group] | None = None,
) -> RankGroups:
    """The groups of ``rank`` among those job_groups lists (``vendors`` and ``data_parallel``
    as there). With ``created`` (create_groups' result on this rank) each carries its torch
    handle; without, none does: a pure function of the topology, testable without processes."""

    def group(role: Role, ranks: Sequence[int], member: bool = True) -> Group:
        ranks = tuple(ranks)
        if created is None or len(ranks) == 1 or not member:
            return Group(ranks)
        return created[(role, ranks)]

    me = topology.ranks[rank]
    tp = group(Role.TENSOR, topology.tp_group(rank))
    stages = topology.replica_stages(me.replica)
    v_shaped = runs_a_v(topology, me.replica)
    interleaved = len(me.chunks) > 1 and not v_shaped  # the last stage feeds the first

    def ranks_of(stage: int) -> tuple[int, ...]:
        return topology.stage_ranks(me.replica, stage % stages)

    own = ranks_of(me.stage)
    prev = nxt = None
    if me.stage > 0 or interleaved:
        prev = group(Role.PIPELINE, ranks_of(me.stage - 1) + own)
    if me.stage < stages - 1 or interleaved:
        nxt = group(Role.PIPELINE, own + ranks_of(me.stage + 1))
    return_prev = return_next = None
    if v_shaped and me.stage < stages - 1:
        return_prev = group(Role.PIPELINE, ranks_of(me.stage + 1) + own)
    if v_shaped and me.stage > 0:
        return_next = group(Role.PIPELINE, own + ranks_of(me.stage - 1))
    peers = topology.data_parallel_peers(rank)
    data = group(Role.DATA, peers) if data_parallel and len(peers) > 1 else None
    grad_sync = {}
    for holders in sorted(set(parameter_holders(topology, model).values())):
        if len(holders) > 1 and tp.ranks[0] in holders:
            stages = [topology.tp_group(leader) for leader in holders]
            grad_sync[holders] = tuple(
                ClassSync(share, _sync_groups(share.ranks, vendors, rank, group))
                for share in sync_classes(stages)
                if rank in share.ranks
            )
    vendor = None
    if len(set(vendors)) > 1:
        vendor = group(
            Role.VENDOR, [r for r in range(topology.world_size) if vendors[r] == vendors[rank]]
        )
    return RankGroups(
        world=group(Role.WORLD, range(topology.world_size)),
        tp=tp,
        pipeline_prev=prev,
        pipeline_next=nxt,
        pipeline_return_prev=return_prev,
        pipeline_return_next=return_next,
        data=data,
        grad_sync=grad_sync,
        vendor=vendor,
    )


def _sync_groups(
    ranks: tuple[int, ...],
    vendors: Sequence[str],
    rank: int,
    group: Callable[..., Group],
) -> SyncGroups:
    """How ``rank`` sums its share of a bucket with the other ``ranks`` of its class: one
    all-reduce among them when they share a vendor, else sliced over every one of them
    (comm.Communicator.sliced_all_reduce)."""
    parts = vendor_parts(ranks, vendors)
    if len(parts) == 1:
        return SyncGroups(group(Role.GRAD_SYNC, parts[0]))
    local = next(part for part in parts if rank in part)
    slices = tuple(
        group(Role.SYNC_BRIDGE, cut.ranks, member=rank in cut.ranks) for cut in bridge_slices(parts)
    )
    return SyncGroups(group(Role.SYNC_LOCAL, local), SlicedBridge(parts, slices))


def create_groups(
    specs: Sequence[GroupSpec], *, members_only: bool = False
) -> dict[tuple[Role, tuple[int, ...]], Group]:
    """Collective over the world group: create every listed group, in order (call it with the
    same list on every rank); the groups this rank is in, by role and ranks (a group of one rank
    without a handle: it never communicates). The world group must exist already.

    ``members_only``: this rank creates only its own groups, each among its ranks alone
    (new_group's ``use_local_synchronization``: named by its ranks, not by how many groups came
    before it) and skips the others. Only where creating a group moves nothing, the dry run's
    fake backend: on a real backend a rank that skips another's group while it creates a later
    one of its own leaves that group's ranks waiting on it."""
    me = dist.get_rank()
    mine = {}
    for spec in specs:
        if members_only and me not in spec.ranks:
            continue
        if spec.role is Role.WORLD:
            handle = dist.group.WORLD
        else:
            handle = dist.new_group(
                list(spec.ranks), backend=spec.backend, use_local_synchronization=members_only
            )
        if me in spec.ranks:
            mine[(spec.role, spec.ranks)] = Group(
                spec.ranks, handle if len(spec.ranks) > 1 else None
            )
    return mine


def create_job_groups(
    topology: Topology,
    model: ModelSpec,
    cluster: ClusterSpec,
    device: torch.device,
    data_parallel: bool = False,
) -> RankGroups:
    """Collective over the world group: create every group of the job of ``topology``, this
    rank running on ``device`` (``data_parallel`` as for job_groups); this rank's. Every rank
    first learns every other's backend (each chose its own device on its own node), so that all
    of them list the same groups."""
    backends: list[str | None] = [None] * topology.world_size
    dist.all_gather_object(backends, device_backend(device))
    vendors = topology.vendors(cluster)
    created = create_groups(job_groups(topology, model, vendors, backends, data_parallel))
    return rank_groups(
        topology,
        model,
        vendors,
        dist.get_rank(),
        data_parallel=data_parallel,
        created=created,
    )
