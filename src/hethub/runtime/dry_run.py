"""A dry run of a whole job in one process: every rank of a plan built, rank after rank, with no
data moved and no memory allocated (`hethub train --dry-run`).

Each rank joins a world of the plan's size on torch's ``fake`` process-group backend
(torch.testing._internal.distributed.fake_pg: a private corner of torch, checked on torch
2.13; its collectives return at once and move nothing), creates its own groups of the job's
list, in the order every real rank creates them (runtime.process_groups), builds its stage on
the meta device (runtime.model.Stage: shapes without storage), lays out its flat buffers
(runtime.precision) and optimizer (runtime.optimizer) by its gradient buckets (spec.buckets),
then leaves the world and drops everything before the next rank: the run's memory is one rank's
metadata.

Why the real run's ``create_job_groups`` cannot be called as it is: ``create_groups`` passes each
group's own backend (gloo for a bridge, the device's library otherwise) to ``dist.new_group``,
and under a fake world a gloo group still builds a real ``ProcessGroupGloo`` on the world's
store. FakeStore is a Python ``dist.Store`` that implements none of the store's methods, so
gloo's first call into it fails c10d's "Not implemented" assertion. The dry run hands
``create_groups`` the same list (job_groups, same order, same ranks) with each backend
replaced by ``fake``; which backend the real group would have is still in the list.

Why a rank creates only its own groups: the list is one pure function's (job_groups), made once
here and so the same for every rank, and a fake group's creation moves nothing; but every rank
creating every group is ranks x groups ``new_group`` calls, thousands of groups on each of
thousands of ranks (hours at 4,088 ranks), where each rank's own are a handful.

Each stage's memory is the runtime's own state (meta tensors have sizes: the weights, fp32 main
gradients, bf16's masters and the Adam moments AdamW makes at its first step), its activations
and the predictor's buffers (StageMemory.buffers_gb: boundary tensors, the peak of a backward,
the last stage's loss), each stage against the predictor's.

The activations are measured: the first rank of each stage runs one micro-batch's forward of
its own stage, on the meta device, under the plan's recomputation as runtime.pipeline runs it,
and records what autograd saves for the backward (runtime.saved_tensors.saved_inventory): one
micro-batch's saved-tensor inventory, whose storages are counted once and whose parameters and
buffers (state, not activations) are left out. Times the micro-batches in flight at the stage's
peak (spec.schedules.in_flight_micro_batches, the predictor's own reading of the schedule, per
chunk for interleaved plans), it is the schedule's peak of activations. Stages of one shape
share one inventory (``_inventory_key``), so a job of thousands of ranks runs a few forwards.

The schedule is checked as sends and receives: each stage's order (spec.schedules) gives the
messages it posts, sends never blocking and receives blocking, as the runtime's isend and recv.
``walk_messages`` runs every stage's posts until none can proceed: a receive whose peer's next
send is another message is a mismatch, one that can never be served a deadlock.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hethub.comm import Communicator
from hethub.errors import HethubError
from hethub.memo import memo_scope
from hethub.runtime.model import Stage, StageChunks
from hethub.runtime.optimizer import PlainAdamW, ShardedAdamW
from hethub.runtime.precision import MasterWeights
from hethub.runtime.process_groups import (
    GroupSpec,
    RankGroups,
    create_groups,
    job_groups,
    rank_groups,
)
from hethub.runtime.saved_tensors import SavedTensors, saved_inventory, stage_inputs
from hethub.runtime.torch_support import fake_store
from hethub.spec.agreement import check_agreement, walk_messages
from hethub.spec.buckets import rank_buckets
from hethub.spec.cluster import ClusterSpec
from hethub.spec.collectives import layout_posts, rank_transfers
from hethub.spec.model import ModelSpec
from hethub.spec.ops import Kernels
from hethub.spec.plan import Plan
from hethub.spec.schedules import in_flight_micro_batches
from hethub.spec.topology import Topology

GB = 1e9
FAKE_BACKEND = "fake"
MEMORY_TOLERANCE = 0.05
"""How far a stage's memory may stand from the prediction's before its verdict says so (the
issue's 5%)."""


@dataclass(frozen=True, slots=True)
class RankState:
    """What one rank's runtime holds across steps, in bytes, as its own tensors say; and, where
    measured, its stage's saved-tensor inventory."""

    weights: int
    grads: int
    optimizer: int
    saved: SavedTensors | None = None

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer


@dataclass(slots=True)
class StageReport:
    """One stage of one pipeline layout over all its replicas: its ranks, the largest state
    among them and its measured activations, against the prediction."""

    pipeline: int
    stage: int
    group: str
    ranks: list[int]
    device_gb: float
    """What the device holds beside its runtime's reserve (AcceleratorSpec.usable_memory_gb)."""
    predicted_state_gb: float
    predicted_activations_gb: float
    predicted_buffers_gb: float
    state_gb: float = 0.0
    activations_gb: float = 0.0
    """The saved-tensor inventory of one micro-batch times the micro-batches in flight."""

    @property
    def memory_gb(self) -> float:
        """The runtime's state and activations, and the predicted buffers above them."""
        return self.state_gb + self.activations_gb + self.predicted_buffers_gb

    @property
    def predicted_memory_gb(self) -> float:
        return self.predicted_state_gb + self.predicted_activations_gb + self.predicted_buffers_gb

    @property
    def verdict(self) -> str:
        """ "ok" where the memory is within MEMORY_TOLERANCE of the prediction, else by how much
        it is off and which part is (each part's share of the predicted memory)."""
        off = abs(self.memory_gb - self.predicted_memory_gb) / max(self.predicted_memory_gb, 1e-12)
        if off <= MEMORY_TOLERANCE:
            return "ok"
        parts = {
            "state": self.state_gb - self.predicted_state_gb,
            "activations": self.activations_gb - self.predicted_activations_gb,
        }
        part = max(parts, key=lambda name: abs(parts[name]))
        share = 100 * parts[part] / max(self.predicted_memory_gb, 1e-12)
        return f"{100 * off:.1f}% off the prediction: {part} {share:+.1f}% of it"


@dataclass(frozen=True, slots=True)
class DryRun:
    """What a dry run found: every stage, the point-to-point messages of one step, and its
    collectives, each checked."""

    ranks: int
    stages: list[StageReport]
    messages: int
    collectives: int = 0
    """The step's collectives in the plan of transfers, every group's agreed by its ranks."""

    def to_json(self) -> dict:
        """The object ``hethub train --dry-run --json`` prints."""
        return {
            "ranks": self.ranks,
            "stages": [
                {
                    "pipeline": s.pipeline,
                    "stage": s.stage,
                    "group": s.group,
                    "ranks": s.ranks,
                    "memory_gb": s.memory_gb,
                    "predicted_memory_gb": s.predicted_memory_gb,
                    "state_gb": s.state_gb,
                    "predicted_state_gb": s.predicted_state_gb,
                    "activations_gb": s.activations_gb,
                    "predicted_activations_gb": s.predicted_activations_gb,
                    "verdict": s.verdict,
                }
                for s in self.stages
            ],
            "messages": self.messages,
            "collectives": self.collectives,
        }


def check_schedules(plan: Plan, topology: Topology) -> int:
    """Walk every pipeline layout's sends and receives (walk_messages); the step's messages over
    every replica."""
    total = 0
    for index, layout in enumerate(plan.pipelines):
        stages, chunks = len(layout.stages), layout.virtual_stages
        if stages == 1:
            continue
        posts = layout_posts(layout.schedule, stages, chunks, layout.micro_batches)
        replica = next(r.replica for r in topology.ranks if r.pipeline == index)

        def name(stage: int, replica: int = replica, index: int = index) -> str:
            leader = topology.stage_ranks(replica, stage)[0]
            return f"rank {leader} (pipeline {index}, stage {stage})"

        total += layout.count * walk_messages(posts, name)
    return total


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """This process as ``rank`` of a fake world of ``world_size``: collectives move nothing."""
    store = fake_store()  # registers "fake"
    dist.init_process_group(FAKE_BACKEND, store=store, rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def member_groups(specs: Sequence[GroupSpec]) -> dict[int, list[GroupSpec]]:
    """Each rank's groups among ``specs``, in the list's order: made once for the whole dry run,
    where each rank scanning the job's thousands of groups would cost seconds a rank."""
    groups: dict[int, list[GroupSpec]] = {}
    for spec in specs:
        for rank in spec.ranks:
            groups.setdefault(rank, []).append(spec)
    return groups


def fake_rank_groups(
    topology: Topology,
    model: ModelSpec,
    vendors: Sequence[str],
    own: Sequence[GroupSpec],
    data_parallel: bool,
) -> RankGroups:
    """In a fake world: this rank's groups, ``own`` (its groups of job_groups, in that list's
    order: member_groups), created as create_job_groups creates them but each on the fake
    backend (the module's docstring says why) and by its members only. Under the fake backend
    a group's creation moves nothing, so a rank's skipping the others' groups changes nothing
    it holds, and the list is one pure function's, the same for every rank by construction:
    the real run's rule (every rank creates every group, in one order) holds. Every rank of a
    vendor has its vendor's library, so the vendors stand for it."""
    created = create_groups(
        [dataclasses.replace(s, backend=FAKE_BACKEND) for s in own], members_only=True
    )
    return rank_groups(
        topology, model, vendors, dist.get_rank(), data_parallel=data_parallel, created=created
    )


def rank_state(
    plan: Plan,
    topology: Topology,
    model: ModelSpec,
    groups: RankGroups,
    comm: Communicator,
    *,
    kernels: Kernels | None = None,
) -> RankState:
    """In a fake world: this rank's stage on the meta device, its flat buffers and optimizer as
    the Engine lays them out, and their bytes; with ``kernels`` (its device's), its stage's
    saved-tensor inventory besides (saved_inventory; TP collectives on the fake group move
    nothing). The stage is made by its constructor under the meta device, as Stage.build
    begins; build's filling of the weights would draw each full tensor on the CPU, which a dry
    run must not."""
    me = topology.ranks[comm.rank]
    with torch.device("meta"):
        stage = StageChunks(
            [
                Stage(
                    model,
                    chunk.first_layer,
                    chunk.layers,
                    groups.tp.handle,
                    is_first=chunk.is_first,
                    is_last=chunk.is_last,
                    sequence_parallel=plan.sequence_parallel,
                )
                for chunk in me.chunks
            ]
        )
    held = rank_buckets(topology, model, comm.rank, peers_have_a_group=groups.data is not None)
    sharded = plan.shard_optimizer and groups.data is not None
    shards = groups.data.size if sharded else 1
    weights = MasterWeights(stage, plan.precision, [b.names for b in held], shards)
    if sharded:
        optimizer = ShardedAdamW(weights, groups.data, 0.0, 0.0, comm)
    else:
        optimizer = PlainAdamW(weights, 0.0, 0.0)
    optimizer.adamw.step()  # AdamW makes its moments at its first step: on meta, sizes only
    saved = None
    if kernels is not None:
        inputs = stage_inputs(stage, model, plan.micro_batch, weights.compute_dtype, "meta")
        recompute = plan.pipelines[me.pipeline].stages[me.stage].recompute
        saved = saved_inventory(stage, inputs, recompute, kernels, plan.precision)
    state = RankState(
        weights=weights.flat.nbytes,
        grads=weights.main_grads.nbytes,
        optimizer=optimizer.state_bytes(),
        saved=saved,
    )
    weights.remove_hooks()  # else the rank's stage, buffers and optimizer outlive it
    return state


@memo_scope()  # every rank's buckets, groups and posts: one Memo
def dry_run(
    plan: Plan,
    topology: Topology,
    model: ModelSpec,
    cluster: ClusterSpec,
    predicted: Sequence,
    progress=None,
) -> DryRun:
    """The schedule's messages checked, and every rank's transfers in the plan of a step's
    traffic (spec.agreement.check_agreement: each group's collectives in one order and size
    on all its ranks); then every rank of ``plan`` built in this process, one after another,
    its memory against ``predicted`` (predictor.predict's stages, StagePrediction).
    ``progress(rank)``, if given, is called before each rank. Raises HethubError naming the
    rank and the rule on a rank over its device's memory, a mismatched send, a deadlock or a
    collective its ranks disagree on."""
    messages = check_schedules(plan, topology)
    vendors = topology.vendors(cluster)
    collectives = check_agreement(
        (rank, rank_transfers(plan, topology, model, vendors, rank, grad_norm=True))
        for rank in range(topology.world_size)
    )
    data_parallel = plan.shard_optimizer or plan.overlap_grad_sync
    by_stage = {(p.pipeline, p.position): p for p in predicted}
    own = member_groups(job_groups(topology, model, vendors, vendors, data_parallel))
    reports: dict[tuple[int, int], StageReport] = {}
    inventories: dict[tuple, SavedTensors] = {}
    for info in topology.ranks:
        if progress is not None:
            progress(info.rank)
        key = (info.pipeline, info.stage)
        accelerator = cluster.group(info.group).accelerator
        kernels = Kernels.of_vendor(accelerator.vendor)
        shape = _inventory_key(plan, topology, info.rank, kernels)
        measure = key not in reports and shape not in inventories
        if key not in reports:
            reports[key] = _stage_report(info, accelerator, by_stage[key].memory)
        report = reports[key]
        with fake_world(info.rank, topology.world_size):
            groups = fake_rank_groups(
                topology, model, vendors, own.get(info.rank, []), data_parallel
            )
            comm = Communicator(vendors)
            state = rank_state(
                plan, topology, model, groups, comm, kernels=kernels if measure else None
            )
        if state.saved is not None:
            inventories[shape] = state.saved
        if not report.ranks:
            in_flight = _in_flight(plan, info)
            report.activations_gb = inventories[shape].activations(in_flight) / GB
        report.ranks.append(info.rank)
        report.state_gb = max(report.state_gb, state.total / GB)
        _check_fits(info, report, state, accelerator)
    return DryRun(topology.world_size, list(reports.values()), messages, collectives)


def _stage_report(info, accelerator, expected) -> StageReport:
    """A stage's report, its ranks still to come (``expected``: the predictor's StageMemory)."""
    return StageReport(
        pipeline=info.pipeline,
        stage=info.stage,
        group=info.group,
        ranks=[],
        device_gb=accelerator.usable_memory_gb,
        predicted_state_gb=expected.state_gb,
        predicted_activations_gb=expected.activations_gb,
        predicted_buffers_gb=expected.buffers_gb,
    )


def _in_flight(plan: Plan, info) -> float:
    """The micro-batches of the stage's activations in flight at its peak: the predictor's
    reading of the schedule (spec.schedules.in_flight_micro_batches), per chunk."""
    layout = plan.pipelines[info.pipeline]
    return in_flight_micro_batches(
        layout.schedule,
        info.stage,
        len(layout.stages),
        layout.micro_batches,
        tuple(chunk.layers for chunk in info.chunks),
    )


def _check_fits(info, report: StageReport, state: RankState, accelerator) -> None:
    """Raise HethubError, naming the rank, where its state, measured activations and predicted
    buffers do not fit its device beside the runtime's reserve (AcceleratorSpec.holds: the
    predictor's and the planner's rule)."""
    above = report.activations_gb + report.predicted_buffers_gb
    need = state.total / GB + above
    if not accelerator.holds(need):
        raise HethubError(
            f"rank {info.rank} (pipeline {info.pipeline}, stage {info.stage}, group "
            f"{info.group}) needs {need:.1f} GB "
            f"({state.total / GB:.1f} GB of state, {report.activations_gb:.1f} GB of "
            f"activations, {report.predicted_buffers_gb:.1f} GB of buffers predicted) on a "
            f"device of {report.device_gb:.1f} usable GB (its memory less its runtime's "
            f"reserve): a rank must fit its device's memory"
        )


def _inventory_key(plan: Plan, topology: Topology, rank: int, kernels: Kernels) -> tuple:
    """What a stage's saved-tensor inventory depends on (the model and the micro-batch are the
    plan's): its chunks' layers and ends, its TP degree, recomputation and device kernels."""
    me = topology.ranks[rank]
    return (
        tuple((c.layers, c.is_first, c.is_last) for c in me.chunks),
        len(topology.tp_group(rank)),
        plan.pipelines[me.pipeline].stages[me.stage].recompute,
        kernels,
    )
