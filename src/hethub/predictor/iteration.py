"""predict(plan, cluster, model) -> Prediction: one optimizer step of a hybrid plan, simulated.

A step: every pipeline layout runs its schedule (simulated event by event); then each stage
all-reduces its gradients with the stages that hold the same layers (natively inside a group,
over the host-staged bridge across vendors), steps the optimizer, and the step ends when the
last device is done.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from hethub.predictor import comm, profiled
from hethub.predictor.calibration import Calibration, default_calibration
from hethub.predictor.compute import (
    BYTES_PER_ELEMENT,
    embedding_cost,
    head_cost,
    layer_cost,
    layer_gemms,
)
from hethub.predictor.memory import (
    GRAD_BYTES,
    StageMemory,
    in_flight_micro_batches,
    stage_memory_at,
    stage_params,
)
from hethub.predictor.schedule import BACKWARD, FORWARD, schedule_order, simulate, stage_end_times
from hethub.predictor.sharing import CoreSharing, SharedLayout, simulate_shared
from hethub.profile.store import LinkProfile, Profiles
from hethub.spec.cluster import ClusterSpec, DeviceGroup
from hethub.spec.model import ModelSpec
from hethub.spec.placement import StageBlock, place
from hethub.spec.plan import PipelineLayout, Plan, Recompute

# Adam on fp32 master weights, per parameter: read the gradient (4), read and write the master
# weight (8) and both moments (16), write the bf16 weight (2).
OPTIMIZER_BYTES_MOVED = 30
OPTIMIZER_OPS = 12  # multi-tensor Adam, grad-norm and the bf16 copy


@dataclass(frozen=True, slots=True)
class StagePrediction:
    """One stage of one pipeline layout (the same for each of its ``count`` replicas)."""

    pipeline: int
    position: int
    group: str
    accelerator: str
    tp: int
    layers: int
    forward_s: float
    """One micro-batch forward, TP communication included."""
    backward_s: float
    """One micro-batch backward, recomputation and TP communication included."""
    compute_s: float
    """All micro-batches of the step: forward plus backward."""
    send_s: float
    """One activation send to the next stage (0 for the last stage)."""
    grad_sync_s: float
    optimizer_s: float
    end_s: float
    """When the stage finishes its last backward."""
    memory: StageMemory


@dataclass(frozen=True, slots=True)
class Prediction:
    iteration_time_s: float
    tokens_per_s: float
    model_tflops_per_device: float
    peak_memory_gb: float
    fits: bool
    devices: int
    bubble_fraction: float
    """Device-weighted share of the pipeline time that stages sit idle."""
    pipeline_time_s: tuple[float, ...]
    """Per pipeline layout: from the first forward to the last backward."""
    stages: tuple[StagePrediction, ...]
    timeline: list[dict] | None = field(default=None, compare=False)
    """With predict(..., timeline=True): every simulated operation and communication."""

    def to_json(self) -> dict:
        """The object ``hethub predict --json`` prints."""
        return {
            "iteration_time_s": self.iteration_time_s,
            "tokens_per_s": self.tokens_per_s,
            "model_tflops_per_device": self.model_tflops_per_device,
            "peak_memory_gb": self.peak_memory_gb,
            "fits": self.fits,
            "devices": self.devices,
            "bubble_fraction": self.bubble_fraction,
            "pipeline_time_s": list(self.pipeline_time_s),
            "stages": [
                {
                    "pipeline": s.pipeline,
                    "stage": s.position,
                    "group": s.group,
                    "accelerator": s.accelerator,
                    "tp": s.tp,
                    "layers": s.layers,
                    "forward_s": s.forward_s,
                    "backward_s": s.backward_s,
                    "compute_s": s.compute_s,
                    "send_s": s.send_s,
                    "grad_sync_s": s.grad_sync_s,
                    "optimizer_s": s.optimizer_s,
                    "memory_gb": s.memory.total_gb,
                    "memory_breakdown_gb": {
                        "weights": s.memory.weights_gb,
                        "grads": s.memory.grads_gb,
                        "optimizer": s.memory.optimizer_gb,
                        "activations": s.memory.activations_gb,
                    },
                }
                for s in self.stages
            ],
        }


@dataclass(frozen=True, slots=True)
class _LayoutCosts:
    """One pipeline layout's per-stage costs, before its schedule is simulated."""

    pipeline: PipelineLayout
    groups: tuple[DeviceGroup, ...]
    forward_s: list[float]
    backward_s: list[float]
    send_s: list[float]
    """Per boundary: an activation forward."""
    send_back_s: list[float]
    """Per boundary: its gradient backward."""

    def fields(self) -> dict:
        """The costs, to build the layout's _LayoutRun from."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(_LayoutCosts)}


@dataclass(frozen=True, slots=True)
class _LayoutRun(_LayoutCosts):
    """One pipeline layout's simulated schedule."""

    stage_end_s: list[float]
    time_s: float
    compute_s: list[float]
    """Per stage: its forwards and backwards of the step, as simulated."""


def predict(
    plan: Plan,
    cluster: ClusterSpec,
    model: ModelSpec,
    *,
    calibration: Calibration | None = None,
    timeline: bool = False,
    profiles: Profiles | None = None,
) -> Prediction:
    """Predict iteration time, throughput and memory of ``plan`` (checked with check_plan) on ``cluster``.

    ``profiles``: measured profiles under the job's run conditions (Profiles.select); what they
    have for a group's accelerator replaces the analytic model's cost (see predictor.profiled),
    what they lack stays analytic. A group's emulated ``speed`` divides its compute times.
    """
    cal = calibration or default_calibration()
    recompute = plan.recompute
    costs = [
        _layout_costs(pipeline, blocks, plan, cluster, model, cal, recompute, profiles)
        for pipeline, blocks in zip(plan.pipelines, place(plan, cluster))
    ]
    sharing = None if profiles is None else profiled.core_sharing(plan, cluster, model, profiles)
    if (
        sharing is not None
    ):  # more ranks than cores: every layout's ranks share them, simulated together
        runs, orders = _simulate_shared(plan, costs, sharing)
    else:
        runs, orders = map(list, zip(*(_simulate(plan, c, timeline) for c in costs)))

    # Replicas with the same stages hold the same parameter shards: they all-reduce natively, as
    # one data-parallel group, whatever their micro-batch counts. Unlike layouts then exchange
    # each stage's shard between them, over the bridge where the vendors differ: hierarchically,
    # each of a layout's replicas carries an equal slice of the shard across (reduce-scatter
    # inside the layout, all-reduce of the slices across layouts, all-gather inside), so the
    # layout with the fewest replicas sets the slice.
    classes: dict[tuple, list[int]] = {}
    for index, run in enumerate(runs):
        classes.setdefault(run.pipeline.stages, []).append(index)
    slowest = max(run.time_s for run in runs)
    fewest = min(sum(runs[i].pipeline.count for i in members) for members in classes.values())
    leaders = {runs[members[0]].groups[0] for members in classes.values()}
    cross_bw = (
        {
            group.name: min(comm.cross_group_bw(cluster, group, leader, cal) for leader in leaders)
            for group in {g for run in runs for g in run.groups}
        }
        if len(classes) > 1
        else {}
    )
    holders = profiled.holders(plan, model) if profiles is not None else (0, 0)
    plan_link = _plan_link(plan, cluster, profiles) if profiles is not None else None
    stages: list[StagePrediction] = []
    step_events: list[dict] = []
    iteration = busy = span = synced = stepped = 0.0
    for index, run in enumerate(runs):
        p, m = len(run.groups), run.pipeline.micro_batches
        members = classes[run.pipeline.stages]
        replicas = sum(runs[i].pipeline.count for i in members)
        for s, (stage, group) in enumerate(zip(run.pipeline.stages, run.groups)):
            start = (
                max(runs[i].stage_end_s[s] for i in members)
                if len(members) > 1
                else run.stage_end_s[s]
            )
            if len(classes) > 1:
                start = slowest
            measured = (
                None
                if profiles is None
                else _profiled_state(
                    model,
                    group,
                    profiles,
                    plan_link,
                    stage.tp,
                    stage.layers,
                    plan.micro_batch,
                    s == 0,
                    s == p - 1,
                    p == 1,
                    *holders,
                )
            )
            params, sync, optimizer = stage_state(
                model, group, cal, stage.tp, stage.layers, s == 0, s == p - 1, p == 1, replicas
            )
            if measured is not None and measured[0] is not None:
                sync = measured[0]  # over every holder of each tensor, whatever its layout
            elif len(classes) > 1:  # a layer's gradient is the mean over every layout's replicas
                sync += comm.ring_allreduce_time(
                    params * GRAD_BYTES / fewest, len(classes), cross_bw[group.name], cal
                )
            if measured is not None and measured[1] is not None:
                optimizer = measured[1]
            compute = run.compute_s[s]
            in_flight = in_flight_micro_batches(plan.schedule, s, p, m)
            stages.append(
                StagePrediction(
                    pipeline=index,
                    position=s,
                    group=group.name,
                    accelerator=group.accelerator.name,
                    tp=stage.tp,
                    layers=stage.layers,
                    forward_s=run.forward_s[s],
                    backward_s=run.backward_s[s],
                    compute_s=compute,
                    send_s=run.send_s[s] if s < p - 1 else 0.0,
                    grad_sync_s=sync,
                    optimizer_s=optimizer,
                    end_s=run.stage_end_s[s],
                    memory=stage_memory_for(
                        model,
                        group,
                        profiles,
                        stage.layers,
                        stage.tp,
                        s == 0,
                        s == p - 1,
                        p == 1,
                        in_flight,
                        plan.micro_batch,
                        recompute,
                    ),
                )
            )
            iteration = max(iteration, start + sync + optimizer)
            synced, stepped = max(synced, start + sync), max(stepped, optimizer)
            devices = run.pipeline.count * stage.tp
            busy += devices * compute
            span += devices * run.time_s
            if timeline:
                base = {"pipeline": index, "stage": s, "group": group.name}
                step_events += [
                    {**base, "kind": "grad_sync", "start_s": start, "end_s": start + sync},
                    {
                        **base,
                        "kind": "optimizer",
                        "start_s": start + sync,
                        "end_s": start + sync + optimizer,
                    },
                ]
    devices = sum(p.count * p.devices for p in plan.pipelines)
    loss_sync = (
        plan_link.allreduce_time(LOSS_REPORT_BYTES, devices) if plan_link is not None else None
    )
    if (
        loss_sync is not None
    ):  # the runtime all-reduces the loss over every rank before the optimizer steps
        iteration = synced + loss_sync + stepped
        for event in step_events:
            if event["kind"] == "optimizer":
                duration = event["end_s"] - event["start_s"]
                event["start_s"], event["end_s"] = synced + loss_sync, synced + loss_sync + duration
    iteration += cal.step_overhead_ms * 1e-3

    return Prediction(
        iteration_time_s=iteration,
        tokens_per_s=plan.global_batch * model.seq_len / iteration,
        model_tflops_per_device=_model_flops(model)
        * plan.global_batch
        / iteration
        / devices
        / 1e12,
        peak_memory_gb=max(s.memory.total_gb for s in stages),
        fits=all(s.memory.total_gb <= cluster.group(s.group).accelerator.memory_gb for s in stages),
        devices=devices,
        bubble_fraction=1.0 - busy / span,
        pipeline_time_s=tuple(run.time_s for run in runs),
        stages=tuple(stages),
        timeline=_timeline(runs, orders) + step_events if timeline else None,
    )


@functools.lru_cache(maxsize=256)
def _model_flops(model: ModelSpec) -> float:
    """Model FLOPs of one sequence, forward and backward (recomputation not counted)."""
    forward = model.layers * sum(flops for flops, _ in layer_gemms(model, 1, 1))
    forward += 2 * model.seq_len * model.hidden * model.vocab
    return 3 * forward


def _layout_costs(
    pipeline: PipelineLayout,
    blocks: list[StageBlock],
    plan: Plan,
    cluster: ClusterSpec,
    model: ModelSpec,
    cal: Calibration,
    recompute: Recompute,
    profiles: Profiles | None,
) -> _LayoutCosts:
    """Per-stage costs of one layout: forward, backward and the sends over each boundary."""
    p, b = len(pipeline.stages), plan.micro_batch
    groups = tuple(cluster.group(stage.group) for stage in pipeline.stages)
    forward, backward, sends, sends_back = [], [], [], []
    for s, (stage, group) in enumerate(zip(pipeline.stages, groups)):
        if profiles is None and group.speed is None:
            f, bw = stage_work(
                model, group, cal, stage.tp, stage.layers, b, recompute, s == 0, s == p - 1
            )
        else:
            f, bw = stage_cost(
                model,
                group,
                cal,
                profiles,
                stage.tp,
                stage.layers,
                b,
                recompute,
                s == 0,
                s == p - 1,
            )
        forward.append(f)
        backward.append(bw)
        if s < p - 1:
            measured = (
                None
                if profiles is None
                else _profiled_send(
                    model,
                    profiles,
                    b,
                    groups[s],
                    groups[s + 1],
                    stage.tp,
                    pipeline.stages[s + 1].tp,
                )
            )
            if measured is None:
                activation_bytes = b * model.seq_len * model.hidden * BYTES_PER_ELEMENT
                measured = (
                    _send_time(activation_bytes / stage.tp, blocks, s, groups, cluster, cal),
                ) * 2
            sends.append(measured[0])
            sends_back.append(measured[1])
    return _LayoutCosts(pipeline, groups, forward, backward, sends, sends_back)


def _simulate(plan: Plan, costs: _LayoutCosts, every_op: bool) -> tuple[_LayoutRun, tuple | None]:
    """One layout's schedule, each operation taking its cost; with ``every_op``, also the
    (order, starts, ends) of every operation, for a timeline."""
    p, m = len(costs.groups), costs.pipeline.micro_batches
    compute = [m * (f + b) for f, b in zip(costs.forward_s, costs.backward_s)]
    if every_op:  # a timeline needs every operation of the full schedule
        order = schedule_order(plan.schedule, p, m)
        end = simulate(
            order, costs.forward_s, costs.backward_s, costs.send_s, costs.send_back_s, every_op=True
        )
        start = [
            finish - (costs.backward_s if kind == BACKWARD else costs.forward_s)[s]
            for (s, kind, _), finish in zip(order.ops, end)
        ]
        stage_end = [end[i] for i in order.last_op]
        return _LayoutRun(
            **costs.fields(), stage_end_s=stage_end, time_s=max(stage_end), compute_s=compute
        ), (order, start, end)
    stage_end = stage_end_times(
        plan.schedule, costs.forward_s, costs.backward_s, costs.send_s, costs.send_back_s, m
    )
    return _LayoutRun(
        **costs.fields(), stage_end_s=stage_end, time_s=max(stage_end), compute_s=compute
    ), None


def _simulate_shared(
    plan: Plan, costs: list[_LayoutCosts], sharing: CoreSharing
) -> tuple[list[_LayoutRun], list]:
    """Every layout's schedule at once, its ranks sharing the machine's cores (predictor.sharing)."""
    layouts = [
        SharedLayout(
            order=schedule_order(plan.schedule, len(c.groups), c.pipeline.micro_batches),
            forward_s=c.forward_s,
            backward_s=c.backward_s,
            send_forward_s=c.send_s,
            send_backward_s=c.send_back_s,
            ranks=[c.pipeline.count * stage.tp for stage in c.pipeline.stages],
            speed=[group.speed or 1.0 for group in c.groups],
        )
        for c in costs
    ]
    runs, orders = [], []
    for c, layout, (start, end) in zip(costs, layouts, simulate_shared(layouts, sharing)):
        compute = [0.0] * len(c.groups)
        for (s, _, _), a, b in zip(layout.order.ops, start, end):
            compute[s] += b - a
        stage_end = [end[i] for i in layout.order.last_op]
        runs.append(
            _LayoutRun(
                **c.fields(), stage_end_s=stage_end, time_s=max(stage_end), compute_s=compute
            )
        )
        orders.append((layout.order, start, end))
    return runs, orders


LOSS_REPORT_BYTES = 4  # the runtime all-reduces each step's loss, one float, over every rank


@functools.lru_cache(maxsize=65536)
def stage_cost(
    model: ModelSpec,
    group: DeviceGroup,
    cal: Calibration,
    profiles: Profiles | None,
    tp: int,
    layers: int,
    micro_batch: int,
    recompute: Recompute,
    first: bool,
    last: bool,
) -> tuple[float, float]:
    """Forward and backward seconds of one micro-batch through a stage: measured where ``profiles``
    hold the layer's key, else analytic (stage_work); divided by the group's emulated speed."""
    profile = (
        None
        if profiles is None
        else profiles.layer_for(group.accelerator.name, model, tp, micro_batch)
    )
    if profile is None:
        forward, backward = stage_work(
            model, group, cal, tp, layers, micro_batch, recompute, first, last
        )
    else:
        forward, backward = profiled.profiled_work(profile, layers, recompute, first, last)
    if group.speed is not None:  # the runtime stretches each forward and backward by 1 / speed
        forward, backward = forward / group.speed, backward / group.speed
    return forward, backward


def stage_memory_for(
    model: ModelSpec,
    group: DeviceGroup,
    profiles: Profiles | None,
    layers: int,
    tp: int,
    first: bool,
    last: bool,
    single_stage: bool,
    in_flight: int,
    micro_batch: int,
    recompute: Recompute,
) -> StageMemory:
    """Peak memory of one device of a stage: measured activations where ``profiles`` hold the
    layer's key, else the analytic model's (stage_memory_at)."""
    profile = (
        None
        if profiles is None
        else profiles.layer_for(group.accelerator.name, model, tp, micro_batch)
    )
    if profile is None:
        return stage_memory_at(
            model, layers, tp, first, last, single_stage, in_flight, micro_batch, recompute
        )
    return profiled.profiled_memory(
        profile,
        model,
        profiles.bytes_per_element,
        layers,
        tp,
        first,
        last,
        single_stage,
        in_flight,
        micro_batch,
        recompute,
    )


def _plan_link(plan: Plan, cluster: ClusterSpec, profiles: Profiles) -> LinkProfile | None:
    """The link profile that prices the plan's gradient sync: every stage of the plan on one kind
    of accelerator, which has a link profile (else the analytic model prices it)."""
    devices = {cluster.group(s.group).accelerator.name for p in plan.pipelines for s in p.stages}
    return profiles.link_for(devices.pop()) if len(devices) == 1 else None


@functools.lru_cache(maxsize=65536)
def _profiled_state(
    model: ModelSpec,
    group: DeviceGroup,
    profiles: Profiles,
    link: LinkProfile | None,
    tp: int,
    layers: int,
    micro_batch: int,
    first: bool,
    last: bool,
    single_stage: bool,
    holders: int,
    embed_holders: int,
) -> tuple[float | None, float | None]:
    """(gradient sync, optimizer step) of a stage from the profiles; None for what they lack."""
    sync = None
    if link is not None and link.device == group.accelerator.name:
        sync = profiled.grad_sync_time(
            link,
            model,
            tp,
            layers,
            first,
            last,
            single_stage,
            holders,
            embed_holders,
            profiles.bytes_per_element,
        )
    profile = profiles.layer_for(group.accelerator.name, model, tp, micro_batch)
    optimizer = (
        None
        if profile is None
        else profiled.optimizer_time(profile, model, tp, layers, first, last, single_stage)
    )
    return sync, optimizer


def _profiled_send(
    model: ModelSpec,
    profiles: Profiles,
    micro_batch: int,
    a: DeviceGroup,
    b: DeviceGroup,
    tp_a: int,
    tp_b: int,
) -> tuple[float, float] | None:
    """Measured times over a boundary between stages on one kind of accelerator, or None."""
    if a.accelerator.name != b.accelerator.name:
        return None
    link = profiles.link_for(a.accelerator.name)
    if link is None:
        return None
    nbytes = (
        micro_batch * model.seq_len * model.hidden * profiles.bytes_per_element
    )  # whole, leader to leader
    return profiled.send_times(link, nbytes, tp_a, tp_b)


@functools.lru_cache(maxsize=65536)
def stage_work(
    model: ModelSpec,
    group: DeviceGroup,
    cal: Calibration,
    tp: int,
    layers: int,
    micro_batch: int,
    recompute: Recompute,
    first: bool,
    last: bool,
) -> tuple[float, float]:
    """Forward and backward seconds of one micro-batch through a stage."""
    acc = group.accelerator
    tp_allreduce = comm.group_allreduce_time(
        micro_batch * model.seq_len * model.hidden * BYTES_PER_ELEMENT, tp, group, cal
    )
    layer = layer_cost(model, acc, cal, tp, micro_batch, recompute, tp_allreduce)
    forward, backward = layers * layer.forward_s, layers * layer.backward_s
    if first:  # vocabulary-parallel embedding: a lookup and one all-reduce
        embed = embedding_cost(model, acc, cal, tp, micro_batch)
        forward, backward = forward + embed.forward_s + tp_allreduce, backward + embed.backward_s
    if last:  # vocabulary-parallel cross-entropy: three all-reduces of one float per token
        head = head_cost(model, acc, cal, tp, micro_batch)
        loss_sync = 3 * comm.group_allreduce_time(micro_batch * model.seq_len * 4, tp, group, cal)
        forward, backward = forward + head.forward_s + loss_sync, backward + head.backward_s
    return forward, backward


@functools.lru_cache(maxsize=65536)
def stage_state(
    model: ModelSpec,
    group: DeviceGroup,
    cal: Calibration,
    tp: int,
    layers: int,
    first: bool,
    last: bool,
    single_stage: bool,
    replicas: int,
) -> tuple[float, float, float]:
    """(parameters per device, gradient all-reduce among the layout's replicas, optimizer step) of a stage."""
    params = stage_params(model, layers, first, last, single_stage) / tp
    replicas_per_node = max(
        1, group.devices_per_node // tp
    )  # stage-major: a stage's replicas share nodes
    sync = comm.group_allreduce_time(params * GRAD_BYTES, replicas, group, cal, replicas_per_node)
    optimizer = max(
        params
        * OPTIMIZER_BYTES_MOVED
        / (group.accelerator.memory_bw_gb_s * 1e9 * cal.memory_efficiency),
        OPTIMIZER_OPS * cal.launch_us * 1e-6,
    )
    return params, sync, optimizer


def _send_time(
    nbytes: float,
    blocks: list[StageBlock],
    s: int,
    groups: tuple[DeviceGroup, ...],
    cluster: ClusterSpec,
    cal: Calibration,
) -> float:
    """Activations from stage s to s+1 (each TP rank sends its share in parallel)."""
    a, b = groups[s], groups[s + 1]
    if a.name != b.name:
        return comm.p2p_time(nbytes, comm.cross_group_bw(cluster, a, b, cal), cal)
    nodes = {
        blocks[s].first_device // a.devices_per_node,
        blocks[s].last_device // a.devices_per_node,
        blocks[s + 1].first_device // a.devices_per_node,
        blocks[s + 1].last_device // a.devices_per_node,
    }
    if len(nodes) == 1:  # both stages of every replica on one node
        return comm.p2p_time(nbytes, comm.intra_node_bw(a, cal), cal)
    return comm.p2p_time(nbytes, comm.network_bw(a, cal), cal)


def _timeline(runs: list[_LayoutRun], orders: list) -> list[dict]:
    """Every simulated operation and activation/gradient send, as trace events."""
    events = []
    for index, (run, (order, start, end)) in enumerate(zip(runs, orders)):
        p = len(run.groups)
        for (s, kind, j), begin, finish in zip(order.ops, start, end):
            base = {"pipeline": index, "stage": s, "group": run.groups[s].name, "micro_batch": j}
            events.append(
                {
                    **base,
                    "kind": "backward" if kind == BACKWARD else "forward",
                    "start_s": begin,
                    "end_s": finish,
                }
            )
            if kind == FORWARD and s < p - 1:
                events.append(
                    {**base, "kind": "send", "start_s": finish, "end_s": finish + run.send_s[s]}
                )
            if kind == BACKWARD and s > 0:
                events.append(
                    {
                        **base,
                        "kind": "send",
                        "start_s": finish,
                        "end_s": finish + run.send_back_s[s - 1],
                    }
                )
    return events
