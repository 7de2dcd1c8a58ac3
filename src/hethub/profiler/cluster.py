"""`hethub profile --cluster`: the distributed profiler, one process per device of the cluster
under the user's torchrun (one agent per node), each node placed as `hethub train` places it
(hethub.runtime.nodes: --this-node GROUP:INDEX or the cluster's hosts).

Who measures what, keeping to what the predictor looks up (profiles.types' keys):

- layers: the first node of each accelerator kind, its first process (the kind's *leader*):
  the local profiler's measurement (layers.measure_layers: the group's TP degrees of --tp that
  divide its devices_per_node, each --micro-batch, each --concurrent-ranks, in fresh processes
  bound and in sessions of their own as a run's workers), on the device the runtime would run
  the group on there (its accelerator, else the CPU). The kinds measure at the same time, each
  on its own node: the other processes wait in a gloo collective, which takes no CPU.
- the link inside a node: the same leader, between processes of its node (measure_links), where
  the group runs on the CPU (gloo between CPU processes is not a GPU's link, as locally).
- the links between nodes: the first process of two nodes, ping-pong over the job's gloo world
  group, one pair at a time (pairs measured at once would share a node's network): two nodes of
  one kind (a group with more than one node), and the first nodes of every two groups of
  different kinds. gloo between hosts is the runtime's bridge between vendors (host-staged),
  and its path between any two nodes run on CPUs; between accelerators of one vendor the
  runtime uses the native library instead, so such a pair is not measured (said in a line).
  A link between nodes is stored by the pair of kinds (LinkProfile.peer).

Everything measured travels to rank 0 (gather_object over gloo), which writes ONE profile folder
(profiles.files' files, load_profiles reads it). Every refusal (a node unknown, an option a
group cannot measure, --out not writable, a measurement that failed) is agreed on by every
process before the next phase, so each node exits with the same one line; every wait is bounded
by --timeout (the process group's timeout).
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from hethub.comm import local_device
from hethub.errors import HethubError
from hethub.profiler.conditions import describe_device, measured_here, timestamp
from hethub.profiler.layers import REPEATS, check_layer_request, measure_layers
from hethub.profiler.links import (
    LINK_REPEATS,
    LINK_SIZES,
    fit_latency_bandwidth,
    measure_links,
    non_decreasing,
    repeats_for_size,
)
from hethub.profiles.files import load_profiles, save_profile
from hethub.profiles.machine import load_average
from hethub.profiles.types import LayerProfile, LinkProfile, node_pair
from hethub.runtime.nodes import Node, claim_plan_rank, node_name, node_ranks
from hethub.runtime.supervision import init_process_group
from hethub.spec.cluster import ClusterSpec
from hethub.spec.model import ModelSpec
from hethub.spec.plan import PipelineLayout, Plan, StageSpec
from hethub.spec.topology import Topology, build_topology

COMMAND = "hethub profile"


@dataclass(frozen=True, slots=True)
class Request:
    """What to measure (the CLI's flags, as `hethub profile` on one machine takes them)."""

    tps: tuple[int, ...]
    micro_batches: tuple[int, ...]
    threads: int
    concurrency: tuple[int, ...]
    dtype: str
    timeout_s: float
    repeats: int | None = None
    """Timed repeats of each layer pass and link message (None: the profiler's own)."""


def profile_layout(cluster: ClusterSpec, model: ModelSpec) -> Plan:
    """The profiling job's processes as a plan: one per device of the cluster, group by group,
    node by node, so that runtime.nodes places each node's processes exactly as for a run."""
    return Plan(
        model=model.name,
        global_batch=cluster.devices,
        micro_batch=1,
        pipelines=tuple(
            PipelineLayout(
                count=group.devices,
                micro_batches=1,
                stages=(StageSpec(group=group.name, tp=1, layers=model.layers),),
            )
            for group in cluster.groups
        ),
    )


def group_tps(tps: Sequence[int], devices_per_node: int) -> tuple[int, ...]:
    """The TP degrees of ``tps`` a group measures: those dividing its devices_per_node (TP stays
    inside a node, as check_plan has it)."""
    return tuple(tp for tp in tps if devices_per_node % tp == 0)


@dataclass(frozen=True, slots=True)
class _Job:
    cluster: ClusterSpec
    topology: Topology
    rank: int
    world: int

    def node_of(self, rank: int) -> Node:
        info = self.topology.ranks[rank]
        return (info.group, info.node)

    def kind(self, rank: int) -> str:
        return self.cluster.group(self.topology.ranks[rank].group).accelerator.name

    def node_leaders(self) -> dict[Node, int]:
        """The first process of every node."""
        return {node: ranks[0] for node, ranks in node_ranks(self.topology).items()}

    def kind_leaders(self) -> dict[str, int]:
        """Per accelerator kind, the first process of its first group's first node: it measures
        the kind's layers and in-node links (two groups of one kind would measure the same)."""
        leaders: dict[str, int] = {}
        for rank in self.node_leaders().values():
            leaders.setdefault(self.kind(rank), rank)
        return leaders


def profile_cluster(
    cluster: ClusterSpec,
    model: ModelSpec,
    node: Node | None,
    request: Request,
    out: Path,
    say: Callable[[str], None] | None = None,
) -> list[LayerProfile | LinkProfile] | None:
    """Run in every process of the user's torchrun: take this node's place, measure this process's
    share, and on rank 0 write every profile into ``out``. Returns what was written (rank 0),
    None elsewhere; HethubError, the same on every process, where anything was refused."""
    topology = build_topology(profile_layout(cluster, model), cluster)
    rank = claim_plan_rank(node, cluster, topology, request.timeout_s, command=COMMAND)
    timeout = datetime.timedelta(seconds=request.timeout_s)
    init_process_group("gloo", timeout, rank)  # the runtime's: the same store, the same care
    try:
        job = _Job(cluster, topology, dist.get_rank(), dist.get_world_size())
        return _profile(job, model, request, out, say)
    finally:
        dist.destroy_process_group()


def _profile(
    job: _Job,
    model: ModelSpec,
    request: Request,
    out: Path,
    say: Callable[[str], None] | None,
) -> list[LayerProfile | LinkProfile] | None:
    me = job.node_of(job.rank)
    group = job.cluster.group(me[0])
    where = local_device(group.accelerator.vendor, int(os.environ.get("LOCAL_RANK", "0")))
    leads = job.kind_leaders().get(job.kind(job.rank)) == job.rank
    tps = group_tps(request.tps, group.devices_per_node)

    # 1. What each process can check alone, agreed on before anything is measured.
    problem = None
    try:
        if job.rank == 0:
            _check_writable(out)
        if leads:
            _check_group(group.name, group.devices_per_node, tps, model, request, where)
    except HethubError as error:
        problem = f"node {node_name(me)} on {socket.gethostname()}: {error}"
    devices = _agree(job, problem, str(where), "checking the request")

    # 2. Each kind's leader measures its layers and in-node links, all kinds at once.
    mine: list[LayerProfile | LinkProfile] = []
    problem = None
    if leads:
        started = time.perf_counter()
        try:
            mine = _measure_kind(job.kind(job.rank), model, tps, request, where, say)
        except (HethubError, RuntimeError) as error:  # torch's own refusals too, in one line
            problem = f"node {node_name(me)}: {_first_line(error)}"
        if say and problem is None:
            say(
                f"node {node_name(me)}: {job.kind(job.rank)} measured on its "
                f"{describe_device(where)} in {time.perf_counter() - started:.1f} s"
            )
    _agree(job, problem, None, "measuring the layers")

    # 3. The links between nodes, one pair at a time.
    problem = None
    for first, second in _pairs(job, devices, say if job.rank == 0 else None):
        if job.rank in (first, second):
            try:
                measured = _pair_link(job, first, second, request.repeats)
            except RuntimeError as error:  # gloo: the peer died or did not answer in time
                problem = f"the link {_pair_name(job, first, second)}: {_first_line(error)}"
                measured = None
            if measured is not None and job.rank == first:
                mine.append(measured)
        _agree(job, problem, None, f"measuring the link {_pair_name(job, first, second)}")

    # 4. Everything to rank 0, which writes the folder.
    gathered: list | None = [None] * job.world if job.rank == 0 else None
    _together(lambda: dist.gather_object(mine, gathered, dst=0), "sending the profiles to rank 0")
    problem, written = None, None
    if job.rank == 0:
        written = [p for profiles in gathered for p in profiles]
        try:
            for profile in written:
                save_profile(out, profile)
            load_profiles(out)  # what predict and plan will read: refused here, not there
        except HethubError as error:
            problem = f"rank 0 on {socket.gethostname()}: {error}"
    _agree(job, problem, None, "writing the profiles")
    return written


def _check_writable(out: Path) -> None:
    """--out can take files: made if need be, and a file written and removed in it."""
    if out.exists() and not out.is_dir():
        raise HethubError(f"--out = '{out}': not a directory (rank 0 writes the profiles there)")
    probe = out / f".hethub-profile-{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise HethubError(
            f"--out = '{out}': cannot write there ({error.strerror}): rank 0 writes the "
            f"profiles there; give a folder it can write"
        ) from None


def _check_group(
    name: str,
    devices_per_node: int,
    tps: tuple[int, ...],
    model: ModelSpec,
    request: Request,
    where: torch.device,
) -> None:
    if not tps:
        raise HethubError(
            f"--tp = {','.join(map(str, request.tps))}: group {name!r} has "
            f"{devices_per_node} devices per node and TP stays inside a node: give at least "
            f"one degree that divides {devices_per_node}"
        )
    for c in request.concurrency:
        check_layer_request(
            model,
            tps,
            request.micro_batches,
            threads=request.threads,
            concurrent_ranks=c,
            dtype=request.dtype,
            device=where,
        )


def _measure_kind(
    kind: str,
    model: ModelSpec,
    tps: tuple[int, ...],
    request: Request,
    where: torch.device,
    say: Callable[[str], None] | None,
) -> list[LayerProfile | LinkProfile]:
    """One kind's layer profiles and (on a CPU) its in-node link profiles, as `hethub profile`
    measures them on one machine."""
    repeats = request.repeats
    found: list[LayerProfile | LinkProfile] = []
    for c in request.concurrency:
        if say:
            say(
                f"{kind}: measuring layers on the {describe_device(where)}: tp "
                f"{','.join(map(str, tps))}, micro-batch "
                f"{','.join(map(str, request.micro_batches))}, {c} at once"
            )
        found += measure_layers(
            model,
            kind,
            tps,
            request.micro_batches,
            threads=request.threads,
            concurrent_ranks=c,
            repeats=repeats or REPEATS,
            timeout_s=request.timeout_s,
            dtype=request.dtype,
            where=where,
        )
        if where.type == "cpu":
            found.append(
                measure_links(
                    kind,
                    tuple(range(2, max(c, 2) + 1)),
                    concurrent_ranks=c,
                    repeats=repeats or LINK_REPEATS,
                    timeout_s=request.timeout_s,
                )
            )
    return found


def _pairs(job: _Job, devices: list, say: Callable[[str], None] | None) -> list[tuple[int, int]]:
    """The pairs of node leaders whose link is measured, one per pair of kinds: two nodes of one
    group, then the first nodes of two groups; not where both run on accelerators of one vendor
    (the runtime's native library, not gloo, joins them)."""
    leaders = job.node_leaders()
    candidates = [
        (leaders[(g.name, 0)], leaders[(g.name, 1)]) for g in job.cluster.groups if g.nodes > 1
    ]
    groups = job.cluster.groups
    candidates += [
        (leaders[(a.name, 0)], leaders[(b.name, 0)])
        for i, a in enumerate(groups)
        for b in groups[i + 1 :]
    ]
    pairs, seen = [], set()
    for first, second in candidates:
        key = node_pair(job.kind(first), job.kind(second))
        if key in seen:
            continue
        seen.add(key)
        vendors = {job.cluster.group(job.node_of(r)[0]).accelerator.vendor for r in (first, second)}
        native = len(vendors) == 1 and all(devices[r] != "cpu" for r in (first, second))
        if native:
            if say:
                say(
                    f"the link {_pair_name(job, first, second)}: not measured (both on "
                    f"{vendors.pop()} accelerators: the runtime joins them with its native "
                    f"library, not gloo)"
                )
            continue
        pairs.append((first, second))
    return pairs


def _pair_name(job: _Job, first: int, second: int) -> str:
    return (
        f"{job.kind(first)} (node {node_name(job.node_of(first))}) <-> {job.kind(second)} "
        f"(node {node_name(job.node_of(second))})"
    )


def _pair_link(job: _Job, first: int, second: int, repeats: int | None) -> LinkProfile:
    """Ping-pong between two processes on two nodes over the world group, at every size of the
    local profiler's: half the round trip is one message."""
    peer = second if job.rank == first else first
    points, load_before = [], load_average()
    for n in LINK_SIZES:
        buffer = torch.zeros(n // 4)

        def op(buffer=buffer):
            if job.rank == first:
                dist.send(buffer, peer)
                dist.recv(buffer, peer)
            else:
                dist.recv(buffer, peer)
                dist.send(buffer, peer)

        op()  # warms up, and the two meet
        count = repeats_for_size(n, repeats or LINK_REPEATS)
        started = time.perf_counter()
        for _ in range(count):
            op()
        points.append((n, (time.perf_counter() - started) / count / 2))
    latency, bandwidth = fit_latency_bandwidth(points)
    device, other = node_pair(job.kind(first), job.kind(second))
    return LinkProfile(
        device=device,
        peer=other,
        concurrent_ranks=2,
        p2p_latency_s=latency,
        p2p_bytes_per_s=bandwidth,
        allreduce={},
        broadcast={},
        allgather={},
        measured_at=timestamp(),
        points={("p2p", 2): non_decreasing(points)},
        # This end's host: the link's other end is the peer group's node.
        measured_on=measured_here(torch.device("cpu"), load_before),
    )


def _agree(job: _Job, problem: str | None, note, what: str) -> list:
    """Every process's (problem, note): the first problem raised on every process, so that each
    node stops with the same line; else the notes, by rank."""
    said: list = [None] * job.world
    _together(lambda: dist.all_gather_object(said, (problem, note)), what)
    for text, _ in said:
        if text:
            raise HethubError(text)
    return [n for _, n in said]


def _together(collective: Callable[[], None], what: str) -> None:
    """A collective of every process, its failure one line: a process that died, or that did
    not get there within --timeout."""
    try:
        collective()
    except RuntimeError as error:  # gloo's timeouts and lost peers (DistError is one)
        raise HethubError(
            f"{what}: not every process answered ({_first_line(error)}); a node's process "
            f"died or took longer than --timeout: see its node's log"
        ) from None


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def summary(profiles: Sequence[LayerProfile | LinkProfile]) -> list[str]:
    """One line per profile written, for rank 0's output."""
    lines = []
    for p in profiles:
        if isinstance(p, LayerProfile):
            lines.append(
                f"layers {p.key.describe()}: forward {p.layer_forward_s * 1e3:.3f} ms, "
                f"backward {p.layer_backward_s * 1e3:.3f} ms"
            )
        elif p.peer is None:
            lines.append(
                f"link inside a node of {p.device}, {p.concurrent_ranks} at once: point to point "
                f"{p.p2p_latency_s * 1e6:.0f} us + {p.p2p_bytes_per_s / 1e9:.2f} GB/s"
            )
        else:
            lines.append(
                f"link between nodes {p.device} <-> {p.peer}: point to point "
                f"{p.p2p_latency_s * 1e6:.0f} us + {p.p2p_bytes_per_s / 1e9:.2f} GB/s"
            )
    return lines
