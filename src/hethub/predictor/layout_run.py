"""One pipeline layout of a plan, priced and run: each stage's forward, backward and W per
micro-batch and its sends (LayoutCosts, from predictor.pricing), then the layout's schedule
simulated event by event (simulate_layout; with more ranks than cores, every layout's ranks
sharing them, simulate_shared_layouts), and its operations as a timeline's events."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hethub.predictor.pricing import Boundary, Pricing
from hethub.predictor.schedule import (
    BACKWARD,
    FORWARD,
    ScheduleOrder,
    schedule_order,
    simulate,
    stage_end_times,
)
from hethub.predictor.sharing import CoreSharing, SharedLayout, simulate_shared
from hethub.predictor.stage import StagePosition, StageShape
from hethub.predictor.weight_split import split_backward, weight_gradient_share
from hethub.report.timeline import OPERATION_KINDS, TimelineEvent
from hethub.spec.cluster import ClusterSpec, DeviceGroup
from hethub.spec.model import ModelSpec
from hethub.spec.placement import StageBlock
from hethub.spec.plan import PipelineLayout, Plan
from hethub.spec.schedules import model_chunk


@dataclass(frozen=True, slots=True)
class LayoutCosts:
    """One pipeline layout's per-stage costs, before its schedule is simulated."""

    pipeline: PipelineLayout
    groups: tuple[DeviceGroup, ...]
    forward_s: list[float]
    """Per model chunk (per stage, without interleaving): one micro-batch."""
    backward_s: list[float]
    """Per model chunk: its backward, or under a zero-bubble schedule its B (the input's
    gradient)."""
    weight_s: list[float]
    """Per model chunk: under a zero-bubble schedule its W (the weights' gradients); else 0."""
    chunk_stage: tuple[int, ...]
    """Per model chunk: the stage that holds it (spec.schedules.model_chunk's inverse)."""
    send_s: list[float]
    """Per boundary between chunks: an activation forward."""
    send_back_s: list[float]
    """Per boundary between chunks: its gradient backward."""

    def fields(self) -> dict:
        """The costs, to build the layout's LayoutRun from."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(LayoutCosts)}

    @property
    def chunks(self) -> int:
        """Chunks per stage."""
        return len(self.forward_s) // len(self.groups)

    def stage_forward_s(self, s: int) -> float:
        """One micro-batch through all of stage ``s``'s chunks, forward."""
        return sum(t for t, at in zip(self.forward_s, self.chunk_stage) if at == s)

    def stage_backward_s(self, s: int) -> float:
        """One micro-batch through all of stage ``s``'s chunks, backward (B and W)."""
        return sum(
            b + w for b, w, at in zip(self.backward_s, self.weight_s, self.chunk_stage) if at == s
        )


@dataclass(frozen=True, slots=True)
class LayoutRun(LayoutCosts):
    """One pipeline layout's simulated schedule."""

    stage_end_s: list[float]
    time_s: float
    compute_s: list[float]
    """Per stage: its forwards and backwards of the step, as simulated."""
    chunk_done_s: list[float]
    """Per model chunk: when its last backward (its last W, under a zero-bubble schedule)
    ends: its gradients are then final."""


def layout_costs(
    pipeline: PipelineLayout,
    blocks: list[StageBlock],
    plan: Plan,
    cluster: ClusterSpec,
    model: ModelSpec,
    pricing: Pricing,
) -> LayoutCosts:
    """Per-chunk costs of one layout (per stage, without interleaving): forward, backward (B and
    W apart under a zero-bubble schedule: predictor.weight_split) and the sends over each
    boundary between the model's chunks. Stage s's chunk c is the model's
    spec.schedules.model_chunk; the first holds the embedding, the last the head; under
    interleaving, the boundary after each round of chunks wraps from the last stage to the
    first; under ZBV, the one at the V's turn stays on the last stage and costs nothing."""
    p, schedule = len(pipeline.stages), pipeline.schedule
    chunk_layers = pipeline.chunk_layers()
    chunks = len(chunk_layers)
    chunk_stage = [0] * chunks
    for s in range(p):
        for c in range(chunks // p):
            chunk_stage[model_chunk(schedule, s, p, c)] = s
    groups = tuple(cluster.group(stage.group) for stage in pipeline.stages)
    forward, backward, weight, sends, sends_back = [], [], [], [], []
    for g, layers in enumerate(chunk_layers):
        s = chunk_stage[g]
        stage, group = pipeline.stages[s], groups[s]
        shape = StageShape(
            model=model,
            layers=layers,
            tp=stage.tp,
            position=StagePosition.of(g, chunks),
            micro_batch=plan.micro_batch,
            recompute=stage.recompute,
            precision=plan.precision,
            sequence_parallel=plan.sequence_parallel,
        )
        times = pricing.work(group, shape)
        forward.append(times.forward_s)
        share = 0.0
        if schedule.splits_backward:
            share = weight_gradient_share(
                model,
                stage.tp,
                plan.micro_batch,
                plan.precision,
                pricing.kernels_on(group),
                stage.recompute,
            )
        input_grad, weight_grad = split_backward(times.backward_s, share)
        backward.append(input_grad)
        weight.append(weight_grad)
        if g < chunks - 1:
            nxt = chunk_stage[g + 1]
            if nxt == s:  # the V's turn: the next chunk is on the same stage
                sends.append(0.0)
                sends_back.append(0.0)
                continue
            boundary = Boundary(
                cluster=cluster,
                model=model,
                micro_batch=plan.micro_batch,
                precision=plan.precision,
                sender=groups[s],
                receiver=groups[nxt],
                tp_sender=stage.tp,
                tp_receiver=pipeline.stages[nxt].tp,
                across_nodes=_across_nodes(blocks, s, nxt, groups),
                sequence_parallel=plan.sequence_parallel,
            )
            sent = pricing.send(boundary)
            sends.append(sent.forward_s)
            sends_back.append(sent.backward_s)
    return LayoutCosts(
        pipeline, groups, forward, backward, weight, tuple(chunk_stage), sends, sends_back
    )


def simulate_layout(
    plan: Plan, costs: LayoutCosts, every_op: bool
) -> tuple[LayoutRun, tuple | None]:
    """One layout's schedule, each operation taking its cost; with ``every_op``, also the
    (order, starts, ends) of every operation, for a timeline."""
    p, m, v = len(costs.groups), costs.pipeline.micro_batches, costs.chunks
    schedule = costs.pipeline.schedule
    compute = [m * (costs.stage_forward_s(s) + costs.stage_backward_s(s)) for s in range(p)]
    if every_op or v > 1 or schedule.splits_backward:  # orders simulated whole (a timeline's too)
        order = schedule_order(schedule, p, m, v)
        end = simulate(
            order,
            costs.forward_s,
            costs.backward_s,
            costs.send_s,
            costs.send_back_s,
            weight_s=costs.weight_s,
            every_op=True,
        )
        stage_end = [end[i] for i in order.last_op]
        run = LayoutRun(
            **costs.fields(),
            stage_end_s=stage_end,
            time_s=max(stage_end),
            compute_s=compute,
            chunk_done_s=[end[i] for i in order.last_gradient_op],
        )
        if not every_op:  # the starts are only a timeline's (a tenth of a planner's prediction)
            return run, None
        durations = (costs.forward_s, costs.backward_s, costs.weight_s)
        start = [
            finish - durations[kind][order.chunk_of(i)]
            for i, ((_, kind, _), finish) in enumerate(zip(order.ops, end))
        ]
        return run, (order, start, end)
    stage_end = stage_end_times(
        schedule,
        costs.forward_s,
        costs.backward_s,
        costs.send_s,
        costs.send_back_s,
        m,
    )
    run = LayoutRun(
        **costs.fields(),
        stage_end_s=stage_end,
        time_s=max(stage_end),
        compute_s=compute,
        chunk_done_s=stage_end,  # one chunk per stage: its last operation is a backward
    )
    return run, None


def _chunk_done(order: ScheduleOrder, end: list[float]) -> list[float]:
    """Per model chunk, the end of its last backward or W (after which its gradients are
    final)."""
    done = [0.0] * (order.stages * order.chunks)
    for i, ((_, kind, _), finish) in enumerate(zip(order.ops, end)):
        if kind != FORWARD:
            g = order.chunk_of(i)
            done[g] = max(done[g], finish)
    return done


def simulate_shared_layouts(
    plan: Plan, costs: list[LayoutCosts], sharing: CoreSharing
) -> tuple[list[LayoutRun], list]:
    """Every layout's schedule at once, its ranks sharing the machine's cores
    (predictor.sharing)."""
    layouts = [
        SharedLayout(
            order=schedule_order(
                c.pipeline.schedule, len(c.groups), c.pipeline.micro_batches, c.chunks
            ),
            forward_s=c.forward_s,
            backward_s=c.backward_s,
            weight_s=c.weight_s,
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
            LayoutRun(
                **c.fields(),
                stage_end_s=stage_end,
                time_s=max(stage_end),
                compute_s=compute,
                chunk_done_s=_chunk_done(layout.order, end),
            )
        )
        orders.append((layout.order, start, end))
    return runs, orders


def _across_nodes(
    blocks: list[StageBlock], a: int, b: int, groups: tuple[DeviceGroup, ...]
) -> bool:
    """Stages a and b are on different nodes (in different groups, or on more than one node of
    their group) for some replica."""
    if groups[a].name != groups[b].name:
        return True
    per_node = groups[a].devices_per_node
    nodes = {
        blocks[a].first_device // per_node,
        blocks[a].last_device // per_node,
        blocks[b].first_device // per_node,
        blocks[b].last_device // per_node,
    }
    return len(nodes) > 1


def first_forward_end(run: LayoutRun, s: int) -> float:
    """When stage ``s``'s first forward of a step ends (of its first chunk, the first
    micro-batch): after that micro-batch's forwards through every stage before it and their
    sends, whatever the schedule. An overlapped param gather hides behind this much of the next
    step (a lower bound: a stage's later layers and chunks start later still)."""
    return sum(run.forward_s[: s + 1]) + sum(run.send_s[:s])


def layout_timeline(runs: list[LayoutRun], orders: list) -> list[TimelineEvent]:
    """Every simulated operation and activation/gradient send, as trace events (a W sends
    nothing, nor does the V's turn, which stays on its stage)."""
    events = []
    for index, (run, (order, start, end)) in enumerate(zip(runs, orders)):
        last_chunk = len(run.forward_s) - 1
        for i, ((s, kind, j), begin, finish) in enumerate(zip(order.ops, start, end)):
            where = {"pipeline": index, "stage": s, "group": run.groups[s].name, "micro_batch": j}
            g = order.chunk_of(i)
            computed = OPERATION_KINDS[kind]
            events.append(TimelineEvent(**where, kind=computed, start_s=begin, end_s=finish))
            if kind == FORWARD and g < last_chunk and run.chunk_stage[g + 1] != s:
                sent = run.send_s[g]
            elif kind == BACKWARD and g > 0 and run.chunk_stage[g - 1] != s:
                sent = run.send_back_s[g - 1]
            else:
                continue
            events.append(TimelineEvent(**where, kind="send", start_s=finish, end_s=finish + sent))
    return events
