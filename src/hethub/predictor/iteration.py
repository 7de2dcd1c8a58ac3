"""predict(plan, cluster, model) -> Prediction: one optimizer step of a hybrid plan, simulated.

A step: every pipeline layout runs its schedule (simulated event by event); then each stage
all-reduces its gradients with the stages that hold the same layers (natively inside a group,
over the host-staged bridge across vendors), steps the optimizer, and the step ends when the
last device is done. What each piece costs is predictor.pricing's answer; what the step says,
predictor.results'.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hethub.errors import HethubError
from hethub.memo import memo_scope
from hethub.predictor import comm, profiled
from hethub.predictor.calibration import Calibration, default_calibration
from hethub.predictor.compute import layer_gemms, missing_fp32, peak_tflops
from hethub.predictor.layout_run import (
    LayoutRun,
    first_forward_end,
    layout_costs,
    layout_timeline,
    simulate_layout,
    simulate_shared_layouts,
)
from hethub.predictor.memory import fits, stage_params, stage_position
from hethub.predictor.pricing import Pricing, SyncPeers, pricing_for
from hethub.predictor.results import Prediction, StagePrediction
from hethub.predictor.stage import StagePosition, StageShape
from hethub.profiles.selection import Profiles
from hethub.report.timeline import TimelineEvent
from hethub.spec.cluster import ClusterSpec
from hethub.spec.model import ModelSpec
from hethub.spec.ops import Kernels
from hethub.spec.placement import place
from hethub.spec.plan import Plan, Precision
from hethub.spec.schedules import in_flight_micro_batches, model_chunk
from hethub.spec.topology import data_parallel_degrees, layout_classes


@memo_scope()  # a search's Memo inside a search, else its own
def predict(
    plan: Plan,
    cluster: ClusterSpec,
    model: ModelSpec,
    *,
    calibration: Calibration | None = None,
    timeline: bool = False,
    profiles: Profiles | None = None,
    kernels: Kernels | None = None,
) -> Prediction:
    """Predict iteration time, throughput and memory of ``plan`` (checked with check_plan) on
    ``cluster``.

    ``profiles``: measured profiles under the job's run conditions (Profiles.select); what they
    have for a group's accelerator replaces the analytic model's cost (see predictor.profiled),
    what they lack stays analytic. A group's emulated ``speed`` divides its compute times.
    ``kernels``: the layer that ran, where a prediction prices another trainer's runs (the
    measured Megatron-LM rows: Kernels.MEGATRON_LM); None, hethub's on each device's own.
    """
    cal = calibration or default_calibration()
    check_precision(
        cluster, plan.precision, dict.fromkeys(s.group for p in plan.pipelines for s in p.stages)
    )
    if profiles is not None:
        profiles = profiled.for_precision(profiles, plan.precision)
    pricing = pricing_for(cal, profiles, kernels)
    costs = [
        layout_costs(pipeline, blocks, plan, cluster, model, pricing)
        for pipeline, blocks in zip(plan.pipelines, place(plan, cluster))
    ]
    sharing = pricing.core_sharing(plan, cluster, model)
    if sharing is not None:  # more ranks than cores: every layout's ranks share them, together
        runs, orders = simulate_shared_layouts(plan, costs, sharing)
    else:
        runs, orders = map(list, zip(*(simulate_layout(plan, c, timeline) for c in costs)))
    step = _StepPricing(
        plan=plan,
        cluster=cluster,
        model=model,
        pricing=pricing,
        sync=_sync_classes(plan, runs, cluster, cal),
    )
    stages = [
        _price_stage(step, runs, index, s)
        for index, run in enumerate(runs)
        for s in range(len(run.groups))
    ]
    return _assemble_step(step, runs, stages, layout_timeline(runs, orders) if timeline else None)


def check_precision(
    cluster: ClusterSpec, precision: Precision, groups: Iterable[str] | None = None
) -> None:
    """Refuse, in one line, fp32 on a group (of ``groups``, default all) whose accelerator has no
    fp32 figure."""
    if precision != Precision.FP32:
        return
    for name in cluster.group_names if groups is None else groups:
        accelerator = cluster.group(name).accelerator
        if accelerator.fp32_tflops is None:
            raise HethubError(
                f"{cluster.source or 'cluster'}: group {name!r}: {missing_fp32(accelerator)}"
            )


@dataclass(frozen=True, slots=True)
class _SyncClasses:
    """Who syncs gradients with whom, per layout, read off spec.topology (layout_classes,
    data_parallel_degrees: what Topology.data_parallel_peers gives each rank).

    Replicas with the same stages hold the same parameter shards: they all-reduce natively, as
    one data-parallel group, whatever their micro-batch counts. Unlike layouts then exchange
    each stage's shard between them, over the bridge where the vendors differ: hierarchically,
    each of a layout's replicas carries an equal slice of the shard across (reduce-scatter
    inside the layout, all-reduce of the slices across layouts, all-gather inside), so the
    layout with the fewest replicas sets the slice.
    """

    classes: int
    """Layout classes (layouts of distinct stages)."""
    peers: list[list[int]]
    """Per layout: the indices of the layouts of its class (itself included)."""
    replicas: list[int]
    """Per layout: its ranks' data-parallel peers, which all-reduce natively together."""
    slowest_s: float
    """The longest pipeline time: where a sync across unlike layouts starts."""
    fewest: int
    """The fewest replicas of one class of layouts."""
    cross_bw: dict[str, float]
    """Per group: its bandwidth to the slowest of the classes' leading groups (only with more
    than one class)."""


def _sync_classes(
    plan: Plan, runs: list[LayoutRun], cluster: ClusterSpec, cal: Calibration
) -> _SyncClasses:
    classes = layout_classes(plan)
    replicas = data_parallel_degrees(plan)
    leaders = {runs[k].groups[0] for k in set(classes)}
    return _SyncClasses(
        classes=len(set(classes)),
        peers=[[i for i, k in enumerate(classes) if k == mine] for mine in classes],
        replicas=list(replicas),
        slowest_s=max(run.time_s for run in runs),
        fewest=min(replicas),
        cross_bw=(
            {
                group.name: min(
                    comm.cross_group_bw(cluster, group, leader, cal) for leader in leaders
                )
                for group in {g for run in runs for g in run.groups}
            }
            if len(set(classes)) > 1
            else {}
        ),
    )


@dataclass(frozen=True, slots=True)
class _StepPricing:
    """What pricing every stage's part of the step needs, the same for all of them."""

    plan: Plan
    cluster: ClusterSpec
    model: ModelSpec
    pricing: Pricing
    sync: _SyncClasses


@dataclass(frozen=True, slots=True)
class _PricedStage:
    prediction: StagePrediction
    sync_start_s: float
    """When its gradient sync can start: its last backward, or, with peers in other layouts,
    the last backward of them all (an overlapped sync: so that it ends when its overlapped
    end is, its whole length before)."""
    gather_hidden_s: float = 0.0
    """Of its param gather, what an overlapped one hides behind the next step's first
    forwards."""

    @property
    def gather_exposed_s(self) -> float:
        """Of its param gather, what shows at the step's end."""
        return self.prediction.param_gather_s - self.gather_hidden_s


def _price_stage(step: _StepPricing, runs: list[LayoutRun], index: int, s: int) -> _PricedStage:
    """Stage ``s`` of layout ``index``: its simulated compute, its gradient sync and optimizer
    step, and its memory."""
    plan, sync = step.plan, step.sync
    run = runs[index]
    stage, group = run.pipeline.stages[s], run.groups[s]
    p, m = len(run.groups), run.pipeline.micro_batches
    peers = sync.peers[index]
    if sync.classes > 1:
        start = sync.slowest_s
    elif len(peers) > 1:
        start = max(runs[i].stage_end_s[s] for i in peers)
    else:
        start = run.stage_end_s[s]
    shape = StageShape(
        model=step.model,
        layers=stage.layers,
        tp=stage.tp,
        position=stage_position(run.pipeline.schedule, s, p),
        micro_batch=plan.micro_batch,
        recompute=stage.recompute,
        precision=plan.precision,
        sequence_parallel=plan.sequence_parallel,
    )
    with_peers = SyncPeers(
        plan=plan,
        cluster=step.cluster,
        pipeline=index,
        stage=s,
        replicas=sync.replicas[index],
        classes=sync.classes,
        fewest=sync.fewest,
        cross_bw=sync.cross_bw.get(group.name, 0.0),
    )
    reduce, gather, exchange = step.pricing.sync(group, shape, with_peers)
    shards = sync.replicas[index] if plan.shard_optimizer else 1
    optimizer = step.pricing.optimizer_s(group, shape) / shards
    if plan.overlap_grad_sync and sync.classes == 1:
        start = _overlapped_sync_end(step.model, runs, peers, s, reduce) - reduce
    elif plan.overlap_grad_sync:
        # What stays inside the vendor hides behind the backwards as a layout's own sync does;
        # the exchange between layouts waits for the slowest of them, and shows after it.
        inside = _overlapped_sync_end(step.model, runs, peers, s, reduce - exchange)
        start = max(start, inside) + exchange - reduce
    hidden = 0.0
    if plan.overlap_param_gather:
        hidden = min(gather, first_forward_end(run, s))
    memory = step.pricing.memory(
        group,
        shape,
        in_flight=in_flight_micro_batches(run.pipeline.schedule, s, p, m, stage.chunks),
        optimizer_shards=shards,
    )
    prediction = StagePrediction(
        pipeline=index,
        position=s,
        group=group.name,
        accelerator=group.accelerator.name,
        tp=stage.tp,
        layers=stage.layers,
        chunks=stage.chunks,
        forward_s=run.stage_forward_s(s),
        backward_s=run.stage_backward_s(s),
        compute_s=run.compute_s[s],
        send_s=run.send_s[s] if s < p - 1 else 0.0,
        grad_sync_s=reduce + gather,
        param_gather_s=gather,
        optimizer_s=optimizer,
        end_s=run.stage_end_s[s],
        memory=memory,
    )
    return _PricedStage(prediction, start, hidden)


def _assemble_step(
    step: _StepPricing,
    runs: list[LayoutRun],
    priced: list[_PricedStage],
    schedule_events: list[TimelineEvent] | None,
) -> Prediction:
    """The step from its priced stages: it ends when the last optimizer step does."""
    plan, cluster, model = step.plan, step.cluster, step.model
    iteration = busy = span = synced = stepped = peak = 0.0
    for stage in priced:
        s, run, start = stage.prediction, runs[stage.prediction.pipeline], stage.sync_start_s
        reduced = start + s.grad_sync_s - s.param_gather_s
        iteration = max(iteration, reduced + s.optimizer_s + stage.gather_exposed_s)
        synced, stepped = max(synced, reduced), max(stepped, s.optimizer_s + stage.gather_exposed_s)
        devices = run.pipeline.count * s.tp
        busy += devices * s.compute_s
        span += devices * run.time_s
        peak += devices * peak_tflops(cluster.group(s.group).accelerator, plan.precision)
    devices = sum(p.count * p.devices for p in plan.pipelines)
    # Where the pricing has it (a link profile), the runtime's way: it all-reduces the loss over
    # every rank, and only then does any rank step its optimizer.
    loss_sync = step.pricing.loss_sync_s(plan, cluster)
    if loss_sync is not None:
        iteration = synced + loss_sync + stepped
    iteration += step.pricing.calibration.step_overhead_ms * 1e-3
    stages = [stage.prediction for stage in priced]
    return Prediction(
        iteration_time_s=iteration,
        tokens_per_s=plan.global_batch * model.seq_len / iteration,
        model_tflops_per_device=_model_flops(model)
        * plan.global_batch
        / iteration
        / devices
        / 1e12,
        mean_peak_tflops=peak / devices,
        peak_memory_gb=max(s.memory.total_gb for s in stages),
        fits=all(fits(s.memory, cluster.group(s.group).accelerator) for s in stages),
        devices=devices,
        bubble_fraction=1.0 - busy / span,
        pipeline_time_s=tuple(run.time_s for run in runs),
        stages=tuple(stages),
        precision=plan.precision,
        schedule=str(plan.schedule),
        shard_optimizer=plan.shard_optimizer,
        overlap_grad_sync=plan.overlap_grad_sync,
        overlap_param_gather=plan.overlap_param_gather,
        timeline=(
            None
            if schedule_events is None
            else schedule_events + _step_events(priced, synced, loss_sync)
        ),
    )


def _step_events(
    priced: list[_PricedStage], synced: float, loss_sync: float | None
) -> list[TimelineEvent]:
    """Each stage's gradient sync and optimizer step, as trace events; after a loss sync, every
    optimizer starts once the last gradient sync and the loss sync are done."""
    events = []
    for stage in priced:
        s, start = stage.prediction, stage.sync_start_s
        sync_end = start + s.grad_sync_s - s.param_gather_s
        optimizer_start, optimizer_end = sync_end, sync_end + s.optimizer_s
        if loss_sync is not None:
            duration = optimizer_end - optimizer_start
            optimizer_start, optimizer_end = synced + loss_sync, synced + loss_sync + duration
        where = {"pipeline": s.pipeline, "stage": s.position, "group": s.group}
        events += [
            TimelineEvent(**where, kind="grad_sync", start_s=start, end_s=sync_end),
            TimelineEvent(**where, kind="optimizer", start_s=optimizer_start, end_s=optimizer_end),
        ]
        if stage.gather_exposed_s > 0:  # what an overlapped gather hides is the next step's
            events.append(
                TimelineEvent(
                    **where,
                    kind="param_gather",
                    start_s=optimizer_end,
                    end_s=optimizer_end + stage.gather_exposed_s,
                )
            )
    return events


def _model_flops(model: ModelSpec) -> float:
    """Model FLOPs of one sequence, forward and backward (recomputation not counted)."""
    forward = model.layers * sum(flops for flops, _ in layer_gemms(model, 1, 1))
    forward += 2 * model.seq_len * model.hidden * model.vocab
    return 3 * forward


def _overlapped_sync_end(
    model: ModelSpec, runs: list[LayoutRun], peers: list[int], s: int, grad_sync: float
) -> float:
    """When stage ``s``'s overlapped gradient sync ends: each layer's gradients are final once
    the last backward of its chunk (over every peer replica) has passed it, going from the
    chunk's last layer to its first, and the sync works through them in that order, one at a
    time, each taking its share of ``grad_sync`` by parameters. Only what is left after the
    stage's last backward shows."""
    run = runs[peers[0]]
    p, chunks, schedule = len(run.groups), run.chunks, run.pipeline.schedule
    # The pass that makes the weights' gradients: the backward, or a zero-bubble schedule's W.
    gradients_s = run.weight_s if schedule.splits_backward else run.backward_s
    pieces = []  # (ready, parameters)
    for c, layers in enumerate(run.pipeline.stages[s].chunks):
        g = model_chunk(schedule, s, p, c)
        params = stage_params(model, layers, StagePosition.of(g, p * chunks))
        done, backward = max(runs[i].chunk_done_s[g] for i in peers), gradients_s[g]
        pieces += [
            (done - backward * (1 - (k + 1) / layers), params / layers) for k in range(layers)
        ]
    total, end = sum(w for _, w in pieces), 0.0
    for ready, params in sorted(pieces):
        end = max(end, ready) + grad_sync * params / total
    return end
