"""Where a cost comes from: one interface, Pricing, and its two implementations.

AnalyticPricing prices every cost from the datasheet models (predictor.compute, comm, memory);
ProfiledPricing prices what measured profiles hold (predictor.profiled) and the rest as
AnalyticPricing does. The step's assembly (predictor.iteration) and the planner (planner.costs)
ask the interface, never which kind they hold.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import NamedTuple

from hethub.errors import HethubError
from hethub.memo import memoized
from hethub.predictor import comm, compute, profiled
from hethub.predictor.calibration import Calibration
from hethub.predictor.compute import (
    embedding_cost,
    head_cost,
    kernels_of,
    layer_cost,
    selective_rerun_share,
)
from hethub.predictor.memory import StageMemory, stage_memory_at, stage_memory_of, stage_params
from hethub.predictor.sharing import CoreSharing
from hethub.predictor.stage import SendTimes, StageShape, StageTimes, SyncTimes
from hethub.profiles.selection import Profiles
from hethub.profiles.types import LayerProfile, LinkProfile
from hethub.spec.cluster import ClusterSpec, DeviceGroup
from hethub.spec.collectives import (
    Kind,
    MessageCut,
    message_cut,
    ring_steps,
    shard_degrees,
)
from hethub.spec.model import ModelSpec
from hethub.spec.ops import Kernels, trainer_bytes
from hethub.spec.plan import Plan, Precision, Recompute

OPTIMIZER_OPS = 12  # multi-tensor Adam, grad-norm and the bf16 copy
REDUCE_SCATTER_SHARE = ring_steps(Kind.REDUCE_SCATTER, 2) / ring_steps(Kind.ALL_REDUCE, 2)
"""A ring reduce-scatter of the gradients over a ring all-reduce of them: half the steps (the
ring factors of spec.collectives, which the runtime counts by)."""


class Boundary(NamedTuple):
    """Where a stage sends one micro-batch's activations to the next and gets their gradient
    back."""

    cluster: ClusterSpec
    model: ModelSpec
    micro_batch: int
    precision: Precision
    sender: DeviceGroup
    receiver: DeviceGroup
    tp_sender: int
    tp_receiver: int
    across_nodes: bool
    """The two stages are on different nodes for some replica."""
    sequence_parallel: bool = False
    """The plan's: the message is the ranks' token shards, cut by tokens and not gathered
    (spec.collectives.message_cut)."""

    @property
    def cut(self) -> MessageCut:
        return message_cut(self.micro_batch, self.model, self.sequence_parallel)


class SyncPeers(NamedTuple):
    """Whom stage ``stage`` of layout ``pipeline`` of ``plan`` sums its gradients with."""

    plan: Plan
    cluster: ClusterSpec
    pipeline: int
    stage: int
    replicas: int
    """Its data-parallel peers (itself included), which sum natively together."""
    classes: int
    """Layout classes of the plan: beyond one, unlike layouts exchange each shard too."""
    fewest: int
    """The fewest replicas of one class, which sets the slice each carries across."""
    cross_bw: float
    """Bytes/s from its group to the slowest of the classes' leading groups (classes > 1)."""

    @property
    def sharded(self) -> bool:
        """A sharded optimizer splits its state among the peers."""
        return self.plan.shard_optimizer and self.replicas > 1


class Pricing(ABC):
    """The costs of a plan's pieces, whatever they are priced from."""

    calibration: Calibration

    @abstractmethod
    def work(self, group: DeviceGroup, shape: StageShape) -> StageTimes:
        """One micro-batch through a stage (or chunk) on ``group``, TP communication and
        recomputation included, stretched by the group's emulated speed."""

    @abstractmethod
    def send(self, boundary: Boundary) -> SendTimes:
        """One micro-batch's activation over ``boundary``, and its gradient back."""

    @abstractmethod
    def sync(self, group: DeviceGroup, shape: StageShape, peers: SyncPeers) -> SyncTimes:
        """A stage's gradient sync with ``peers``."""

    @abstractmethod
    def optimizer_s(self, group: DeviceGroup, shape: StageShape) -> float:
        """A stage's optimizer step over all of one rank's parameters (a sharded optimizer's
        share is this over its shards)."""

    @abstractmethod
    def memory(
        self, group: DeviceGroup, shape: StageShape, *, in_flight: float, optimizer_shards: int
    ) -> StageMemory:
        """Peak memory of one device of a stage holding ``in_flight`` micro-batches'
        activations, its optimizer state split over ``optimizer_shards`` ranks."""

    @abstractmethod
    def loss_sync_s(self, plan: Plan, cluster: ClusterSpec) -> float | None:
        """The step's all-reduce of the loss over every rank, before any optimizer steps; None
        where it is left to the step's fixed overhead."""

    @abstractmethod
    def core_sharing(
        self, plan: Plan, cluster: ClusterSpec, model: ModelSpec
    ) -> CoreSharing | None:
        """How the plan's ranks share one machine's cores, or None where they do not."""


@memoized
def pricing_for(
    calibration: Calibration, profiles: Profiles | None, kernels: Kernels | None = None
) -> Pricing:
    """The pricing of ``profiles`` (selected under the job's run conditions, in the plan's
    dtype) where there are any, else the analytic model's; its layers priced as ``kernels``
    run them (None: the runtime's layer on each device's own, compute.kernels_of)."""
    if profiles is None:
        return AnalyticPricing(calibration, kernels=kernels)
    return ProfiledPricing(calibration, profiles, kernels=kernels)


@dataclass(frozen=True)  # no slots: ProfiledPricing's methods call super()
class AnalyticPricing(Pricing):
    """Every cost from the analytic model."""

    calibration: Calibration
    kernels: Kernels | None = field(default=None, kw_only=True)
    """The layer that ran, where it is not the runtime's on the device's own kernels (the
    measured Megatron-LM runs: Kernels.MEGATRON_LM)."""

    def work(self, group: DeviceGroup, shape: StageShape) -> StageTimes:
        return _at_speed(group, _analytic_work(group, self.calibration, shape, self.kernels))

    def send(self, boundary: Boundary) -> SendTimes:
        """Each TP rank's run of the message over the boundary (the busiest rank's pieces,
        spec.collectives.shard_pieces), then, where the message is cut flat, the receiving
        stage's all-gather of the runs: the next stage's for an activation, this one's for its
        gradient back (under sequence parallelism each rank keeps its tokens: no gather)."""
        b, cal, cut = boundary, self.calibration, boundary.cut
        nbytes = cut.numel * b.precision.element_bytes
        sender, receiver = shard_degrees(cut.positions, b.tp_sender, b.tp_receiver)
        message = _send_time(nbytes / min(sender, receiver), b, cal)
        if not cut.gathered:
            return SendTimes(message, message)
        forward = comm.group_all_gather_time(nbytes, receiver, b.receiver, cal)
        backward = comm.group_all_gather_time(nbytes, sender, b.sender, cal)
        return SendTimes(message + forward, message + backward)

    def sync(self, group: DeviceGroup, shape: StageShape, peers: SyncPeers) -> SyncTimes:
        """The gradients' all-reduce among the peers (a reduce-scatter and an all-gather with a
        sharded optimizer), and with unlike layouts the exchange of each shard across them:
        hierarchically, each of a layout's replicas carrying an equal slice of it across."""
        cal, precision = self.calibration, shape.precision
        grad_bytes = trainer_bytes(self.kernels_on(group), precision).grad_sync
        params = stage_params(shape.model, shape.layers, shape.position) / shape.tp
        reduce = _analytic_sync_s(group, cal, params, shape.tp, peers.replicas, grad_bytes)
        gather = 0.0
        if peers.sharded:
            # Identical layouts alone reduce-scatter their buckets; with unlike layouts the sum
            # goes through the bridge whole, and each rank keeps its slice. Either way the peers
            # then all-gather the updated weights.
            gather = reduce * all_gather_share(precision)
            if peers.classes == 1:
                reduce *= REDUCE_SCATTER_SHARE
        exchange = 0.0
        if peers.classes > 1:  # a layer's gradient is the mean over every layout's replicas
            exchange = comm.ring_allreduce_time(
                params * grad_bytes / peers.fewest,
                peers.classes,
                peers.cross_bw,
                cal,
            )
        return SyncTimes(reduce + exchange, gather, exchange)

    def optimizer_s(self, group: DeviceGroup, shape: StageShape) -> float:
        params = stage_params(shape.model, shape.layers, shape.position) / shape.tp
        return _analytic_optimizer_s(
            group, self.calibration, params, shape.precision, self.kernels_on(group)
        )

    def memory(
        self, group: DeviceGroup, shape: StageShape, *, in_flight: float, optimizer_shards: int
    ) -> StageMemory:
        return stage_memory_at(shape, in_flight, optimizer_shards, self.kernels_on(group))

    def loss_sync_s(self, plan: Plan, cluster: ClusterSpec) -> float | None:
        return None

    def kernels_on(self, group: DeviceGroup) -> Kernels:
        """The kernels ``group``'s layers are priced as running."""
        return self.kernels or kernels_of(group.accelerator)

    def core_sharing(
        self, plan: Plan, cluster: ClusterSpec, model: ModelSpec
    ) -> CoreSharing | None:
        return None


@dataclass(frozen=True)
class ProfiledPricing(AnalyticPricing):
    """Measured costs where ``profiles`` hold them (looked up under their selected dtype; a
    plan is priced by the profiles of its precision), the analytic model's elsewhere."""

    profiles: Profiles

    def work(self, group: DeviceGroup, shape: StageShape) -> StageTimes:
        profile = self._layer(group, shape)
        if profile is None:
            return super().work(group, shape)
        share = (
            self._selective_share(group, shape) if shape.recompute is Recompute.SELECTIVE else 0.0
        )
        times = profiled.profiled_work(
            profile, shape.layers, shape.recompute, shape.position, share
        )
        return _at_speed(group, times)

    def _selective_share(self, group: DeviceGroup, shape: StageShape) -> float:
        """The analytic model's share of a layer's forward that selective recomputation runs
        again in its backward (compute.selective_rerun_share), on ``group``'s kernels."""
        return selective_rerun_share(
            shape.layer,
            group.accelerator,
            self.calibration,
            _tp_allreduce_s(group, self.calibration, shape),
            self.kernels_on(group),
        )

    def send(self, boundary: Boundary) -> SendTimes:
        return _measured_send(self.profiles, boundary) or super().send(boundary)

    def sync(self, group: DeviceGroup, shape: StageShape, peers: SyncPeers) -> SyncTimes:
        """The runtime's collectives (profiled.sync_collectives): a vendor's own on its kind's
        link profile, the bridge's over the measured links between the plan's kinds; the
        analytic model's where a link or a collective was not measured."""
        profiles, kind = self.profiles, group.accelerator.name
        link = profiles.link_for(kind)
        if link is not None:
            collectives = profiled.sync_collectives(
                peers.plan, peers.cluster, shape.model, peers.pipeline, peers.stage
            )
            kinds = _plan_kinds(peers.plan, peers.cluster) - {kind}
            bridge = [profiles.link_between(kind, other) for other in sorted(kinds)]
            measured = profiled.grad_sync_time(link, collectives, [b for b in bridge if b])
            if measured is not None:  # over every holder of each tensor, whatever its layout
                # one class of layouts: its sums through the leaders (the tied head's) wait for
                # no other layout's stages
                return measured if peers.classes > 1 else measured._replace(exchange_s=0.0)
        return super().sync(group, shape, peers)

    def optimizer_s(self, group: DeviceGroup, shape: StageShape) -> float:
        profile = self._layer(group, shape)
        if profile is None:
            return super().optimizer_s(group, shape)
        return profiled.optimizer_time(profile, shape.model, shape.tp, shape.layers, shape.position)

    def memory(
        self, group: DeviceGroup, shape: StageShape, *, in_flight: float, optimizer_shards: int
    ) -> StageMemory:
        profile = self._layer(group, shape)
        if profile is None:
            return super().memory(
                group, shape, in_flight=in_flight, optimizer_shards=optimizer_shards
            )
        # The measured layer's activations; around them, what the runtime holds as the analytic
        # model prices it (the state, the stage's buffers on the device's kernels).
        return stage_memory_of(
            shape,
            per_layer=profile.layer_activation_bytes,
            in_flight=in_flight,
            optimizer_shards=optimizer_shards,
            kernels=self.kernels_on(group),
        )

    def loss_sync_s(self, plan: Plan, cluster: ClusterSpec) -> float | None:
        """With the plan's link profile, the runtime's way: one fp32 float all-reduced over
        every rank."""
        link = _plan_link(self.profiles, plan, cluster)
        if link is None:
            return None
        devices = sum(p.count * p.devices for p in plan.pipelines)
        return link.allreduce_time(plan.precision.loss_bytes, devices)

    def core_sharing(
        self, plan: Plan, cluster: ClusterSpec, model: ModelSpec
    ) -> CoreSharing | None:
        return profiled.core_sharing(plan, cluster, model, self.profiles)

    def _layer(self, group: DeviceGroup, shape: StageShape) -> LayerProfile | None:
        profile = self.profiles.layer_for(
            group.accelerator.name, shape.model, shape.tp, shape.micro_batch
        )
        if profile is not None and shape.split_sequence:
            # A profile measures the layer without sequence parallelism (hethub profile runs
            # none): its time and activations are not this layer's, and pricing it analytically
            # beside measured stages would compare two calibrations.
            raise HethubError(
                f"sequence_parallel: profiles of {group.accelerator.name} at tp {shape.tp} "
                f"measure the layer without sequence parallelism, which this plan runs: predict "
                f"it without profiles, or with sequence_parallel: false"
            )
        return profile


def all_gather_share(precision: Precision) -> float:
    """A sharded optimizer's all-gather of the updated weights (in the training dtype) over the
    all-reduce of the fp32 gradients it replaces: half the steps, of weight-sized elements."""
    return REDUCE_SCATTER_SHARE * precision.weight_bytes / precision.main_grad_bytes


def _at_speed(group: DeviceGroup, times: StageTimes) -> StageTimes:
    """``times`` on a group of emulated ``speed``: the runtime stretches each forward and
    backward by 1 / speed."""
    if group.speed is None:
        return times
    return StageTimes(times.forward_s / group.speed, times.backward_s / group.speed)


@memoized
def _analytic_work(
    group: DeviceGroup, cal: Calibration, shape: StageShape, kernels: Kernels | None
) -> StageTimes:
    """One micro-batch through a stage, from the analytic model, its layers run on ``kernels``
    (None: the device's own)."""
    model, tp, micro_batch, precision = shape.model, shape.tp, shape.micro_batch, shape.precision
    acc = group.accelerator
    tp_allreduce = _tp_allreduce_s(group, cal, shape)
    layer = layer_cost(shape.layer, acc, cal, tp_allreduce, kernels, tp_group=group)
    forward, backward = shape.layers * layer.forward_s, shape.layers * layer.backward_s
    if shape.split_sequence:
        edges = _sequence_parallel_edges(group, cal, shape)
        forward, backward = forward + edges.forward_s, backward + edges.backward_s
    if shape.position.first:  # vocabulary-parallel embedding: a lookup and one all-reduce
        embed = embedding_cost(model, acc, cal, tp, micro_batch, precision)
        # sequence parallel: a reduce-scatter in the all-reduce's place (in the edges)
        reduce = 0.0 if shape.split_sequence else tp_allreduce
        forward, backward = forward + embed.forward_s + reduce, backward + embed.backward_s
    if shape.position.last:  # vocabulary-parallel cross-entropy: three all-reduces of a float
        head = head_cost(model, acc, cal, tp, micro_batch, precision)
        loss_sync = 3 * comm.group_allreduce_time(
            micro_batch * model.seq_len * precision.loss_bytes, tp, group, cal
        )
        forward, backward = forward + head.forward_s + loss_sync, backward + head.backward_s
    return StageTimes(forward, backward)


def _tp_allreduce_s(group: DeviceGroup, cal: Calibration, shape: StageShape) -> float:
    """One all-reduce of a layer's hidden states, one micro-batch, over the stage's TP group."""
    model = shape.model
    nbytes = shape.micro_batch * model.seq_len * model.hidden * shape.precision.element_bytes
    return comm.group_allreduce_time(nbytes, shape.tp, group, cal)


def _sequence_parallel_edges(group: DeviceGroup, cal: Calibration, shape: StageShape) -> StageTimes:
    """A sequence-parallel stage's collectives outside its layers (runtime.model.Stage): the
    first stage's embedding reduce-scattered (GPT: its position embedding's gradient summed);
    the last stage's final norm on the shard (its weight's gradient summed) gathered before the
    head (the head's input gradient reduce-scattered). Each all-gather or reduce-scatter carries
    one (B, T, h) activation. Another stage's input and output are its shard, sent by tokens
    (runtime.p2p): nothing at its edges."""
    model, tp, e = shape.model, shape.tp, shape.precision.element_bytes
    activation = shape.micro_batch * model.seq_len * model.hidden * e
    half = comm.group_all_gather_time(activation, tp, group, cal)
    forward = backward = 0.0
    if shape.position.first:
        forward += half
        if model.arch == "gpt":  # every row of the position table, the unused ones too
            positions = model.position_rows * model.hidden * e
            backward += comm.group_allreduce_time(positions, tp, group, cal)
    if shape.position.last:
        forward += half
        backward += half
        norm_weights = 2 if model.arch == "gpt" else 1  # LayerNorm's weight and bias
        backward += norm_weights * comm.group_allreduce_time(model.hidden * e, tp, group, cal)
    return StageTimes(forward, backward)


@memoized
def _analytic_sync_s(
    group: DeviceGroup, cal: Calibration, params: float, tp: int, replicas: int, grad_bytes: int
) -> float:
    """All-reduce of one rank's gradients (``params`` parameters of a stage of TP ``tp``,
    ``grad_bytes`` each) among its stage's ``replicas``, stage-major: a stage's replicas share
    nodes."""
    replicas_per_node = max(1, group.devices_per_node // tp)
    return comm.group_allreduce_time(params * grad_bytes, replicas, group, cal, replicas_per_node)


@memoized
def _analytic_optimizer_s(
    group: DeviceGroup, cal: Calibration, params: float, precision: Precision, kernels: Kernels
) -> float:
    """The optimizer step over one rank's ``params`` parameters, as the trainer that runs it
    (spec.ops.trainer_bytes): memory-bound, or its launches where they take longer."""
    return max(
        compute.memory_time(
            params * trainer_bytes(kernels, precision).optimizer, group.accelerator
        ),
        compute.launch_time(OPTIMIZER_OPS, group.accelerator, cal),
    )


def _send_time(nbytes: float, boundary: Boundary, cal: Calibration) -> float:
    """``nbytes`` from a device of the sender to one of the receiver."""
    a, b = boundary.sender, boundary.receiver
    if a.name != b.name:
        return comm.p2p_time(nbytes, comm.cross_group_bw(boundary.cluster, a, b, cal), cal)
    if not boundary.across_nodes:  # both stages of every replica on one node
        return comm.p2p_time(nbytes, comm.intra_node_bw(a, cal), cal)
    return comm.p2p_time(nbytes, comm.network_bw(a, cal), cal)


def _measured_send(profiles: Profiles, boundary: Boundary) -> SendTimes | None:
    """Measured times over a stage boundary, or None: between two nodes, the TP ranks' pieces
    over the measured link between their kinds (hethub profile --cluster; through the bridge
    where the vendors differ) and each stage's all-gather of them from its own kind's link
    profile; else on one kind of accelerator, its link profile (one machine's processes)."""
    b = boundary
    cut = b.cut
    element = profiles.bytes_per_element
    kind_a, kind_b = b.sender.accelerator.name, b.receiver.accelerator.name
    between = profiles.link_between(kind_a, kind_b) if b.across_nodes else None
    if between is not None:
        return profiled.cross_send_times(
            between,
            profiles.link_for(kind_a),
            profiles.link_for(kind_b),
            cut,
            element,
            tp_sender=b.tp_sender,
            tp_receiver=b.tp_receiver,
        )
    if kind_a != kind_b:
        return None
    link = profiles.link_for(kind_a)
    if link is None:
        return None
    return profiled.send_times(link, cut, element, tp_sender=b.tp_sender, tp_receiver=b.tp_receiver)


def _plan_kinds(plan: Plan, cluster: ClusterSpec) -> set[str]:
    """The accelerator kinds the plan's stages run on."""
    return {cluster.group(s.group).accelerator.name for p in plan.pipelines for s in p.stages}


def _plan_link(profiles: Profiles, plan: Plan, cluster: ClusterSpec) -> LinkProfile | None:
    """The link profile that prices the plan's loss all-reduce over every rank: every stage of
    the plan on one kind of accelerator, which has a link profile (else the analytic model
    prices it)."""
    devices = _plan_kinds(plan, cluster)
    return profiles.link_for(devices.pop()) if len(devices) == 1 else None
