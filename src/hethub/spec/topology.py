"""Who does what: from a plan and a cluster, every rank's replica, stage, TP rank, group and device,
the TP groups, and which stages hold a copy of each parameter (the gradient sync's sets).

A pure function of its inputs, testable without processes. Ranks are laid out by group (in the
cluster file's order) and by device inside the group (node by node), over the devices the plan
uses; which device runs which stage is hethub.spec.placement's answer, the one the predictor prices.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from hethub.memo import memoized
from hethub.spec.cluster import ClusterSpec
from hethub.spec.model import ModelSpec
from hethub.spec.parameters import stage_parameters
from hethub.spec.placement import place
from hethub.spec.plan import PipelineLayout, Plan
from hethub.spec.schedules import model_chunk


@dataclass(frozen=True, slots=True)
class Chunk:
    """Consecutive layers of the model that one stage runs as one piece."""

    index: int
    """The model's chunk: chunk c of stage s of p is spec.schedules.model_chunk (c x p + s but
    under ZBV)."""
    first_layer: int
    layers: int
    is_first: bool
    """It embeds the tokens (the model's first chunk)."""
    is_last: bool
    """It holds the head and computes the loss (the model's last chunk)."""


@dataclass(frozen=True, slots=True)
class RankInfo:
    """One process of the job."""

    rank: int
    pipeline: int
    """Index of its layout in plan.pipelines."""
    replica: int
    """Global index of its data-parallel replica (layouts' replicas numbered in plan order)."""
    stage: int
    tp_rank: int
    tp: int
    group: str
    device: int
    """Index of its device inside its group."""
    node: int
    """Index of its node inside its group."""
    first_layer: int
    """The first layer of its first chunk."""
    layers: int
    """All its layers, over its chunks."""
    micro_batches: int
    """Micro-batches its replica runs per step."""
    chunks: tuple[Chunk, ...] = ()
    """The model chunks its stage holds, in its schedule's chunk order (one unless its pipeline
    interleaves)."""
    layout_class: int = 0
    """The first layout of the plan with its layout's stages: ranks of one class, stage and TP
    rank hold the same shard of the same parameters (its data-parallel peers)."""

    def describe(self) -> str:
        """How a message names this rank: "rank 1 (group amd, replica 0, stage 1)"."""
        return f"rank {self.rank} (group {self.group}, replica {self.replica}, stage {self.stage})"


@dataclass(frozen=True, slots=True)
class Topology:
    ranks: tuple[RankInfo, ...]
    tp_groups: tuple[tuple[int, ...], ...]
    """The ranks of every (replica, stage), in TP-rank order."""
    _index: _RankIndex = field(init=False, repr=False, compare=False, hash=False)
    """The lookups below, made once: each rank's groups ask them for every rank of the job,
    and a scan of every rank per question is seconds a rank at thousands of ranks."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", _RankIndex.of(self.ranks, self.tp_groups))

    def __hash__(self) -> int:
        """The fields' hash, made once: parameter_holders' cache hashes the topology at each
        call, which would hash every rank's RankInfo each time (thousands at scale)."""
        return self._index.hash

    def __reduce__(self):
        """Pickled as its fields: the index (its hash among it, of strings, which differ from
        process to process) is made afresh where it is loaded."""
        return (Topology, (self.ranks, self.tp_groups))

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def stage_ranks(self, replica: int, stage: int) -> tuple[int, ...]:
        """The TP group of one stage of one replica, in rank order."""
        return self._index.stage_ranks.get((replica, stage), ())

    def replica_stages(self, replica: int) -> int:
        return self._index.replica_stages[replica]

    def tp_group(self, rank: int) -> tuple[int, ...]:
        """The TP group (of tp_groups) ``rank`` is in."""
        return self._index.tp_group[rank]

    def data_parallel_peers(self, rank: int) -> tuple[int, ...]:
        """The ranks holding exactly ``rank``'s parameter shards (itself included): the same
        stage and TP rank of every replica of identical layouts. A sharded optimizer splits
        its state among them; with all of a parameter's holders among them, they sum its
        gradient directly, each its own shard."""
        return self._index.peers[_shard_of(self.ranks[rank])]

    def vendors(self, cluster: ClusterSpec) -> list[str]:
        """Every rank's accelerator vendor, in rank order."""
        return [cluster.group(r.group).accelerator.vendor for r in self.ranks]


def _shard_of(r: RankInfo) -> tuple[int, int, int]:
    """What the ranks holding the same parameter shards share (Topology.data_parallel_peers)."""
    return (r.layout_class, r.stage, r.tp_rank)


@dataclass(frozen=True, slots=True)
class _RankIndex:
    """Topology's lookups by key, each list in rank order, as a scan of the ranks finds it."""

    stage_ranks: Mapping[tuple[int, int], tuple[int, ...]]
    replica_stages: Mapping[int, int]
    tp_group: Mapping[int, tuple[int, ...]]
    peers: Mapping[tuple[int, int, int], tuple[int, ...]]
    hash: int
    """The Topology's, of its compared fields."""

    @staticmethod
    def of(ranks: tuple[RankInfo, ...], tp_groups: tuple[tuple[int, ...], ...]) -> _RankIndex:
        stage_ranks: dict[tuple[int, int], list[int]] = {}
        peers: dict[tuple[int, int, int], list[int]] = {}
        replica_stages: dict[int, int] = {}
        for r in ranks:
            stage_ranks.setdefault((r.replica, r.stage), []).append(r.rank)
            peers.setdefault(_shard_of(r), []).append(r.rank)
            replica_stages[r.replica] = max(replica_stages.get(r.replica, 0), r.stage + 1)
        tp_group: dict[int, tuple[int, ...]] = {}
        for group in reversed(tp_groups):  # a rank in two groups: the first, as a scan finds
            tp_group.update(dict.fromkeys(group, group))
        return _RankIndex(
            {k: tuple(v) for k, v in stage_ranks.items()},
            replica_stages,
            tp_group,
            {k: tuple(v) for k, v in peers.items()},
            hash((ranks, tp_groups)),
        )


@memoized
def parameter_holders(topology: Topology, model: ModelSpec) -> Mapping[str, tuple[int, ...]]:
    """For every full-model parameter: the leaders (first TP rank) of the stages holding a copy,
    sorted. Their gradients are summed over exactly these (every replica, and the GPT head's
    copy of the embedding). Read-only, made once per topology: a rank's groups, buckets, norm
    and checkpoint all ask, and at 768 ranks of 140B it walks every stage's parameter list."""
    holders: dict[str, set[int]] = {}
    names_of: dict[tuple, list[str]] = {}  # replicas of one layout hold the same chunks
    for r in topology.ranks:
        if r.tp_rank != 0:
            continue  # a stage's leader stands for its TP ranks
        for chunk in r.chunks:
            key = (chunk.first_layer, chunk.layers, chunk.is_first, chunk.is_last)
            if key not in names_of:
                names_of[key] = stage_parameters(
                    model,
                    chunk.first_layer,
                    chunk.layers,
                    is_first=chunk.is_first,
                    is_last=chunk.is_last,
                )
            for name in names_of[key]:
                holders.setdefault(name, set()).add(r.rank)
    return MappingProxyType({name: tuple(sorted(ranks)) for name, ranks in holders.items()})


def layout_classes(plan: Plan) -> tuple[int, ...]:
    """Per layout of ``plan``, its class: the first layout with its stages and its schedule
    (RankInfo's layout_class). Ranks of one class, stage and TP rank hold the same shard of the
    same parameters: they are each other's data-parallel peers (Topology.data_parallel_peers).
    One schedule too: an overlapped sync starts each bucket's sum among the peers as their
    backwards finish it, so they must give their gradients in one order, and a zero-bubble
    stage's W gives them in another order than a 1F1B stage's backward."""
    return tuple(
        next(
            k
            for k, other in enumerate(plan.pipelines)
            if (other.stages, other.schedule) == (pipeline.stages, pipeline.schedule)
        )
        for pipeline in plan.pipelines
    )


def data_parallel_degrees(plan: Plan) -> tuple[int, ...]:
    """Per layout of ``plan``: how many data-parallel peers each of its ranks has (itself
    included), len(Topology.data_parallel_peers(rank)), read off the plan without building
    the topology: the replicas of every layout of its class."""
    classes = layout_classes(plan)
    replicas = [0] * len(classes)
    for pipeline, k in zip(plan.pipelines, classes):
        replicas[k] += pipeline.count
    return tuple(replicas[k] for k in classes)


def build_topology(plan: Plan, cluster: ClusterSpec) -> Topology:
    """Every rank of the job that runs ``plan`` (checked with check_plan) on ``cluster``."""
    placed = place(plan, cluster)
    slots = []  # (group order, device, pipeline, replica, stage, tp_rank)
    replica_base = 0
    for i, (pipeline, blocks) in enumerate(zip(plan.pipelines, placed)):
        for block in blocks:
            for r in range(pipeline.count):
                for t, device in enumerate(block.devices(r)):
                    slots.append(
                        (
                            cluster.group_names.index(block.group),
                            device,
                            i,
                            replica_base + r,
                            block.stage,
                            t,
                        )
                    )
        replica_base += pipeline.count
    slots.sort()
    classes = layout_classes(plan)
    ranks = []
    for rank, (g, device, i, replica, stage, t) in enumerate(slots):
        pipeline = plan.pipelines[i]
        group = cluster.groups[g]
        chunks = _stage_chunks(pipeline, stage)
        ranks.append(
            RankInfo(
                rank=rank,
                pipeline=i,
                replica=replica,
                stage=stage,
                tp_rank=t,
                tp=pipeline.stages[stage].tp,
                group=group.name,
                device=device,
                node=device // group.devices_per_node,
                first_layer=chunks[0].first_layer,
                layers=pipeline.stages[stage].layers,
                micro_batches=pipeline.micro_batches,
                chunks=chunks,
                layout_class=classes[i],
            )
        )
    tp_groups: dict[tuple[int, int], list[int]] = {}
    for r in ranks:
        tp_groups.setdefault((r.replica, r.stage), []).append(r.rank)
    return Topology(
        tuple(ranks),
        tuple(tuple(sorted(v, key=lambda k: ranks[k].tp_rank)) for v in tp_groups.values()),
    )


def _stage_chunks(pipeline: PipelineLayout, stage: int) -> tuple[Chunk, ...]:
    """The chunks stage ``stage`` of ``pipeline`` holds: its chunk c is the model's
    spec.schedules.model_chunk."""
    sizes = pipeline.chunk_layers()
    p = len(pipeline.stages)
    return tuple(
        Chunk(
            index=g,
            first_layer=sum(sizes[:g]),
            layers=sizes[g],
            is_first=g == 0,
            is_last=g == len(sizes) - 1,
        )
        for g in (
            model_chunk(pipeline.schedule, stage, p, c) for c in range(pipeline.virtual_stages)
        )
    )
