"""Lower bounds on a candidate's step that cost less than drafting or predicting it: the
search skips whatever cannot beat the best step so far (planner.drafts.evaluate_jobs) and the
local search whatever cannot replace its plan (planner.local_search)."""

from __future__ import annotations

import dataclasses
import enum

from hethub.memo import memoized
from hethub.planner.candidates import (
    Layout,
    Structure,
    tp_degrees,
)
from hethub.planner.costs import (
    Setting,
    StageSlot,
    end_time,
    layer_time,
    stage_caps,
    stage_position,
)
from hethub.planner.partition import (
    least_bottleneck,
    relaxed_bottleneck,
)
from hethub.planner.search_state import SearchState, setting_of
from hethub.predictor.stage import StagePosition
from hethub.spec.cluster import ClusterSpec
from hethub.spec.plan import (
    Plan,
    StageSpec,
)
from hethub.spec.schedules import (
    Schedule,
    stage_model_chunks,
)


class Floor(enum.IntEnum):
    """How far a job in evaluate_jobs's queue is made out: each key is at most the next one's."""

    SETTING = 0  # setting_floor: every job of one setting at once
    RELAXED = 1  # structure_floor over _relaxed_bottleneck
    WHOLE = 2  # over _least_bottleneck without memory caps
    CAPPED = 3  # over _least_bottleneck under the draft's memory caps
    DRAFTED = 4  # the draft's bound


FLOOR_MARGIN = 1e-9
"""Rounding headroom: a floor must never exceed the bound it stands for."""


def setting_floor(state: SearchState, setting: Setting) -> float:
    """At most structure_floor of every structure under ``setting``: a stage of TP t on group
    g passes a layer at a rate 1 / layer_time, at most t x r_g, r_g the best rate a device of g
    reaches at any degree, so the layers of all micro-batches take at least their count over
    the rate of every device at its best (the embedding and the head only add). 0 where the
    ranks share the cores."""
    if state.profiles is not None:
        return 0.0
    rate = sum(
        group.devices
        * max(1 / (tp * layer_time(setting, group, tp)) for tp in tp_degrees(group, state.model))
        for group in state.cluster.groups
    )
    total = state.global_batch // setting.micro_batch
    return total * state.model.layers / rate * (1 - FLOOR_MARGIN)


def structure_floor(
    state: SearchState, setting: Setting, structure: Structure, known: Floor
) -> float | None:
    """At most the bounds of every draft of ``structure``, without drafting it (None: it has no
    draft): the slowest replica takes at least the time at which the layouts, each running
    micro-batches at its least bottleneck, would share them all. The least bottleneck, from
    cheapest and lowest to dearest and highest (``known``): that of layers as real numbers
    (_relaxed_bottleneck), of whole layers, of whole layers under the memory caps
    (_least_bottleneck). 0 where the ranks share the cores (the draft scales its bound by how
    much faster a stage may then run)."""
    total = state.global_batch // setting.micro_batch
    replicas = sum(layout.count for layout in structure)
    if replicas == 0 or total < replicas:
        return None
    if state.profiles is not None:
        return 0.0
    nominal = max(1, total // replicas)
    rate = 0.0
    for layout in structure:
        bottleneck = (
            _relaxed_bottleneck(setting, state.cluster, layout.slots)
            if known == Floor.RELAXED
            else _least_bottleneck(
                setting, state.cluster, layout, nominal if known == Floor.CAPPED else None
            )
        )
        if bottleneck is None:
            return None
        rate += layout.count / bottleneck
    return total / rate * (1 - FLOOR_MARGIN)


@memoized
def _stage_costs(
    setting: Setting, cluster: ClusterSpec, slots: tuple[StageSlot, ...]
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Each stage's time per layer and its extra time (embedding, head) per micro-batch, as
    _partition prices them (each kind of stage and place priced once: a pipeline has few)."""
    p = len(slots)
    priced: dict[tuple[StageSlot, StagePosition], tuple[float, float]] = {}
    per_layer, extra = [], []
    for s, slot in enumerate(slots):
        where = (slot, stage_position(setting.schedule, s, p))
        if where not in priced:
            group = cluster.group(slot.group)
            priced[where] = (
                layer_time(setting, group, slot.tp),
                end_time(setting, group, slot.tp, where[1]),
            )
        per_layer.append(priced[where][0])
        extra.append(priced[where][1])
    return tuple(per_layer), tuple(extra)


@memoized
def _relaxed_bottleneck(
    setting: Setting, cluster: ClusterSpec, slots: tuple[StageSlot, ...]
) -> float:
    per_layer, extra = _stage_costs(setting, cluster, slots)
    return relaxed_bottleneck(setting.model.layers, per_layer, extra)


@memoized
def _least_bottleneck(
    setting: Setting, cluster: ClusterSpec, layout: Layout, micro_batches: int | None
) -> float | None:
    """least_bottleneck of the layout under the memory caps of its draft at ``micro_batches``
    (None: no caps): at most the bottleneck of the draft's split."""
    per_layer, extra = _stage_costs(setting, cluster, layout.slots)
    layers = setting.model.layers
    caps = (
        [layers] * len(layout.slots)
        if micro_batches is None
        else stage_caps(setting, cluster, layout.slots, micro_batches, 1, layout.count)
    )
    return least_bottleneck(layers, per_layer, extra, caps)


def compute_floor(state: SearchState, plan: Plan) -> float:
    """At most ``plan``'s predicted step: the most, over its pipelines' stages, of a stage's
    forwards and backwards of every micro-batch one after another, after the forwards of the
    first round of chunks before it and followed by their backwards (_stage_floors), priced as
    the predictor prices them. 0 where ranks share the cores, which speeds a stage up while
    others wait."""
    if state.profiles is not None:
        return 0.0
    setting = setting_of(state, plan)
    return max(
        before + pipeline.micro_batches * work
        for pipeline in plan.pipelines
        for before, work in _stage_floors(
            setting, state.cluster, pipeline.stages, pipeline.schedule
        )
    )


@memoized
def _stage_floors(
    setting: Setting, cluster: ClusterSpec, stages: tuple[StageSpec, ...], schedule: Schedule
) -> tuple[tuple[float, float], ...]:
    """Per stage s: (the forward plus backward of one micro-batch through the model's chunks 0
    to s - 1, its forward plus backward of one micro-batch over all its chunks), each chunk
    priced at its place among the model's chunks, as predict() prices it.

    A stage runs its operations one at a time. Every one of them waits for its micro-batch's
    forward through the model's chunks before the stage's first (chunks 0 to s - 1, on the
    stages before), and its last operation, a backward, is followed by that micro-batch's
    backward through them; the step ends after both, and after the stage's gradient sync and
    optimizer step (predictor.iteration): so the step takes at least the sum."""
    p, chunks = len(stages), len(stages[0].chunks)
    groups = [cluster.group(stage.group) for stage in stages]
    chunk_s = {}  # model chunk -> forward plus backward of one micro-batch
    waited = {}  # model chunk -> what a later stage waits for of it: its forward and backward,
    # its forward alone where backwards split (a zero-bubble stage's last operation may be a W,
    # which the backwards through the chunks before it can overlap)
    mine = stage_model_chunks(schedule, p, chunks)  # each stage's model chunks
    for stage, group, held in zip(stages, groups, mine):
        own = dataclasses.replace(setting, recompute=stage.recompute)
        for g, layers in zip(held, stage.chunks):
            times = own.pricing.work(
                group, own.shape(stage.tp, layers, StagePosition.of(g, p * chunks))
            )
            chunk_s[g] = times.forward_s + times.backward_s
            waited[g] = times.forward_s if schedule.splits_backward else chunk_s[g]
    # a stage's first chunk is the model's s (a chunk c x p + s, or the V's s and 2p - 1 - s)
    floors, before = [], 0.0
    for s in range(p):
        floors.append((before, sum(chunk_s[g] for g in mine[s])))
        before += waited[s]
    return tuple(floors)
