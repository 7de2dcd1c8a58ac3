"""Drafts: a structure made concrete (layers from the exact partitioner, micro-batches from the
balanced split) with lower bounds on its step; a phase's jobs drafted and predicted most
promising first (evaluate_jobs), then interleaved and tried under the zero-bubble schedules."""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass

from hethub.planner.candidates import (
    Layout,
    Structure,
)
from hethub.planner.costs import (
    Setting,
    StageSlot,
    end_time,
    layer_time,
    stage_caps,
    stage_position,
)
from hethub.planner.floors import Floor, setting_floor, structure_floor
from hethub.planner.partition import (
    chunk_split,
    partition_chunks,
    stage_times,
)
from hethub.planner.search_state import PricedPlan, SearchState, predict_and_keep
from hethub.planner.split import ReplicaTiming, split_micro_batches
from hethub.predictor import Prediction
from hethub.predictor.profiled import core_sharing
from hethub.predictor.stage import StagePosition
from hethub.spec.cluster import ClusterSpec, DeviceGroup
from hethub.spec.plan import (
    PipelineLayout,
    Plan,
    StageSpec,
)
from hethub.spec.schedules import (
    Schedule,
    chunks_per_stage,
    stage_model_chunks,
)

ZERO_BUBBLE = (Schedule.ZB_H1, Schedule.ZBV)
"""The zero-bubble schedules the search tries on the structures it has predicted."""


VIRTUAL_STAGES = (1, 2, 4)  # chunks per stage (interleaved 1F1B) where the layers allow


@dataclass(frozen=True, slots=True)
class Draft:
    plan: Plan
    bound: float
    """A lower bound on the plan's step: the slowest replica's m x bottleneck plus a quarter of
    its fill, the fill a v-th as long over v chunks a stage."""
    interleaved_bound: float
    """The same bound at the most chunks a stage its layouts allow: the least any of the
    structure's interleavings can take."""


def evaluate_jobs(
    state: SearchState, jobs: list[tuple[Setting, Structure]], phase: str
) -> list[tuple[PricedPlan, int]]:
    """Predict the jobs' plans (one chunk a stage), most promising first, skipping those that
    cannot beat the bar, then interleave those that came near it (_interleave). Returns the
    fitting plans, each with its job's index.

    A plan's step takes at least m x bottleneck (its slowest stage busy with every micro-batch)
    plus a quarter of the other stages' time per micro-batch (the forwards before it and the
    backwards after it), a v-th of that over v chunks a stage. A structure is predicted unless
    even its most interleaved bound is above the best step predicted so far.

    Drafting (partitioning the layers, splitting the micro-batches) costs more than most
    candidates are worth, so a job is drafted only once its floor (structure_floor: at most
    its draft's bound) is the least of what is left: the drafts then come in the order of their
    bounds, exactly as if all were drafted first, and those whose floor is above the bar are
    never drafted.
    """
    # (floor or bound, job, how far it is made out, the draft's plan)
    queue: list[tuple[float, int, Floor, Plan | None]] = []
    unplaceable_before = len(state.unplaceable)
    # A setting's jobs by the first one's index, which stands for them all in the queue.
    members: dict[int, list[int]] = {}
    if state.prune:
        first_of: dict[Setting, int] = {}
        for index, (setting, _) in enumerate(jobs):
            members.setdefault(first_of.setdefault(setting, index), []).append(index)
        for first in members:
            queue.append((setting_floor(state, jobs[first][0]), first, Floor.SETTING, None))
    for index, (setting, structure) in enumerate(jobs if not state.prune else ()):
        if state.progress and index % 64 == 0:
            state.progress(phase, index, 2 * len(jobs))
        if state.out_of_time():
            break
        draft = make_draft(state, setting, structure, 1)
        if draft is not None:
            queue.append((draft.interleaved_bound, index, Floor.DRAFTED, draft.plan))
    heapq.heapify(queue)
    results: list[PricedPlan | None] = [None] * len(jobs)
    done, drafted = 0, set()
    while queue and not state.out_of_time():
        bound, index, known, plan = heapq.heappop(queue)
        if bound >= state.best_time:
            break  # a floor or bound is at most every bound behind it
        if known == Floor.SETTING:  # the setting's jobs, each by its own floor
            for member in members[index]:
                floor = structure_floor(state, *jobs[member], Floor.RELAXED)
                if floor is not None:
                    heapq.heappush(queue, (floor, member, Floor.RELAXED, None))
            continue
        if known < Floor.CAPPED:  # make it out further, and queue it again
            floor = structure_floor(state, *jobs[index], Floor(known + 1))
            if floor is not None:
                heapq.heappush(queue, (floor, index, Floor(known + 1), None))
            continue
        if known == Floor.CAPPED:
            drafted.add(index)
            draft = make_draft(state, *jobs[index], 1)
            if draft is not None:
                heapq.heappush(queue, (draft.interleaved_bound, index, Floor.DRAFTED, draft.plan))
            continue
        if state.progress and done % 16 == 0:
            share = done * len(jobs) // (done + len(queue))
            state.progress(phase, len(jobs) + share, 2 * len(jobs))
        done += 1
        results[index] = predict_and_keep(state, plan)
    if state.prune and state.best_time == float("inf"):
        # Nothing fits: the error names the closest candidate of all, so every job is drafted,
        # and those that fit no split go in the jobs' order, as without floors.
        for index in range(len(jobs)):
            if index not in drafted and not state.out_of_time():
                make_draft(state, *jobs[index], 1)
        position = {job: index for index, job in reversed(list(enumerate(jobs)))}
        state.unplaceable[unplaceable_before:] = sorted(
            state.unplaceable[unplaceable_before:], key=position.__getitem__
        )
    if state.progress:
        state.progress(phase, 2 * len(jobs), 2 * len(jobs))
    fitting = [(ranked, index) for index, ranked in enumerate(results) if ranked is not None]
    return fitting + _interleave(state, jobs, results)


def _interleave(
    state: SearchState, jobs: list[tuple[Setting, Structure]], plain: list[PricedPlan | None]
) -> list[tuple[PricedPlan, int]]:
    """The predicted structures again over 2, 4, ... chunks a stage, and under the zero-bubble
    schedules (ZB-H1 on one chunk a stage, ZBV on two), most promising first.

    Interleaving v chunks a stage shortens a pipeline's fill and drain about v-fold and nothing
    else, so a plan can gain at most (1 - 1 / v) of its pipelines' idle time (a pipeline's time
    less its busiest stage's compute); a zero-bubble schedule at most all of it (its W's fill
    the waits). A variant whose one-chunk step less that gain cannot beat the best step so far
    is never drafted."""
    tries = []
    for index, ranked in enumerate(plain):
        if ranked is None:
            continue
        idle = _idle_s(ranked.prediction)
        step = ranked.prediction.iteration_time_s
        for v in VIRTUAL_STAGES[1:]:
            tries.append((step - idle * (1 - 1 / v), index, v, Schedule.INTERLEAVED_1F1B))
        for schedule in ZERO_BUBBLE:
            if schedule == Schedule.ZBV and state.model.tied_head:
                continue  # check_plan's rule: the V's first stage would hold both ends
            tries.append((step - idle, index, chunks_per_stage(schedule), schedule))
    tries.sort()
    results = []
    for bound, index, v, schedule in tries:
        if bound >= state.best_time or state.out_of_time():
            break
        setting, structure = jobs[index]
        if schedule.splits_backward:
            setting = dataclasses.replace(setting, schedule=schedule)
        draft = make_draft(state, setting, structure, v)
        if draft is None or draft.plan.schedule != schedule:
            continue  # no layout of the structure has the layers for v chunks a stage
        if draft.bound < state.best_time and (ranked := predict_and_keep(state, draft.plan)):
            results.append((ranked, index))
    return results


def _idle_s(prediction: Prediction) -> float:
    """The longest of the plan's pipelines' idle time: its time less its busiest stage's."""
    busiest: dict[int, float] = {}
    for stage in prediction.stages:
        busiest[stage.pipeline] = max(busiest.get(stage.pipeline, 0.0), stage.compute_s)
    return max(prediction.pipeline_time_s[i] - busy for i, busy in busiest.items())


def chunks_allowed(layout: Layout, layers: int, chunks: int) -> int:
    """``chunks`` a stage where the layout has 2 stages or more and a layer for every chunk,
    else 1."""
    p = len(layout.slots)
    return chunks if p >= 2 and p * chunks <= layers else 1


def make_draft(
    state: SearchState, setting: Setting, structure: Structure, chunks: int
) -> Draft | None:
    """Layers per stage (and chunk) and micro-batches per replica for a structure, each layout
    interleaved over ``chunks`` chunks a stage where its layers allow, and lower bounds on its
    step. Replicas of one layout shard their optimizer, overlap their gradient sync with the
    backward and the optimizer's weight gather with the next forwards (sharding frees memory
    for layers; refine_best tries each best plan unsharded too)."""
    total = state.global_batch // setting.micro_batch
    replicas = sum(layout.count for layout in structure)
    if replicas == 0 or total < replicas:
        return None
    nominal = max(1, total // replicas)
    layers = state.model.layers
    splits, timings, widths = [], [], []
    for layout in structure:
        v = chunks_allowed(layout, layers, chunks)
        if setting.schedule == Schedule.ZBV and v != chunks:
            return None  # the V needs two chunks on every stage of every layout
        split, times = _partition(setting, state.cluster, layout, nominal, v)
        if split is None:
            if chunks == 1:
                state.unplaceable.append((setting, structure))
            return None
        bottleneck = max(times)
        splits.append(split)
        widths.append((v, chunks_allowed(layout, layers, VIRTUAL_STAGES[-1])))
        timings.append(ReplicaTiming(layout.count, bottleneck, sum(times) - bottleneck))
    shares = split_micro_batches(total, timings)
    if shares is None:
        return None
    pipelines, bound, interleaved_bound = [], 0.0, 0.0
    for layout, split, share, timing, (v, most) in zip(structure, splits, shares, timings, widths):
        stages = tuple(
            StageSpec.of_chunks(slot.group, slot.tp, chunk_layers)
            for slot, chunk_layers in zip(layout.slots, split)
        )
        pipelines += [
            PipelineLayout(count=count, micro_batches=m, stages=stages) for count, m in share
        ]
        busiest = max(m for _, m in share) * timing.bottleneck_s
        if setting.schedule.splits_backward:
            # W's may fill every wait but the busiest stage's own work: no fill is certain
            bound, interleaved_bound = max(bound, busiest), max(interleaved_bound, busiest)
            continue
        bound = max(bound, busiest + timing.fill_s / (4 * v))
        interleaved_bound = max(interleaved_bound, busiest + timing.fill_s / (4 * most))
    data_parallel = any(layout.count > 1 for layout in structure)
    plan = Plan(
        model=state.model_ref,
        global_batch=state.global_batch,
        micro_batch=setting.micro_batch,
        recompute=setting.recompute,
        schedule=(
            Schedule.INTERLEAVED_1F1B
            if setting.schedule != Schedule.ZBV
            and any(len(p.stages[0].chunks) > 1 for p in pipelines)
            else setting.schedule
        ),
        precision=setting.precision,
        shard_optimizer=data_parallel,
        overlap_grad_sync=data_parallel,
        # the sharded optimizer's weight gather behind the next step's forwards: the runtime
        # waits for it wherever weights are read between steps (checkpoints, the end)
        overlap_param_gather=data_parallel,
        sequence_parallel=setting.sequence_parallel,
        pipelines=tuple(pipelines),
    )
    sharing = (
        None
        if state.profiles is None
        else core_sharing(plan, state.cluster, state.model, state.profiles)
    )
    if sharing is not None:
        # ranks sharing the cores compute faster while others wait: so may every stage
        bound *= sharing.alone
        interleaved_bound *= sharing.alone
    return Draft(plan, bound, min(bound, interleaved_bound))


def _partition(
    setting: Setting, cluster: ClusterSpec, layout: Layout, micro_batches: int, chunks: int
) -> tuple[list[tuple[int, ...]] | None, list[float] | None]:
    """The exact layer split of one layout over ``chunks`` chunks a stage (each stage's layers
    per chunk), and its stages' times per micro-batch."""
    p = len(layout.slots)
    groups = [cluster.group(slot.group) for slot in layout.slots]
    per_layer = [layer_time(setting, g, slot.tp) for g, slot in zip(groups, layout.slots)]
    extra = [
        end_time(setting, g, slot.tp, stage_position(setting.schedule, s, p))
        for s, (g, slot) in enumerate(zip(groups, layout.slots))
    ]
    caps = list(stage_caps(setting, cluster, layout.slots, micro_batches, chunks, layout.count))
    split = partition_chunks(setting.model.layers, per_layer, extra, caps, micro_batches, chunks)
    if split is None:
        return None, None
    if chunks == 1:
        return [(n,) for n in split], stage_times(split, per_layer, extra)
    # The embedding's time is on the first stage's first chunk, the head's on the last's last
    # (under ZBV's V, on the first stage's second chunk).
    chunked = [
        tuple(
            chunk_split(
                n, chunks, per_layer[s], _chunk_extras(setting, groups[s], slot, s, p, chunks)
            )
        )
        for s, (n, slot) in enumerate(zip(split, layout.slots))
    ]
    return chunked, stage_times(split, per_layer, extra)


def _chunk_extras(
    setting: Setting, group: DeviceGroup, slot: StageSlot, stage: int, stages: int, chunks: int
) -> list[float]:
    """The time each of the stage's ``chunks`` chunks spends on the embedding or the head,
    besides its layers: each end where spec.schedules.model_chunk puts the model's first and
    last chunk."""
    held = stage_model_chunks(setting.schedule, stages, chunks)[stage]
    last = stages * chunks - 1
    first_only, last_only = StagePosition.of(0, 2), StagePosition.of(1, 2)
    return [
        end_time(setting, group, slot.tp, first_only) * (g == 0)
        + end_time(setting, group, slot.tp, last_only) * (g == last)
        for g in held
    ]
