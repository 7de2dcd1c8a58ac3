"""The planner's search: structures x plan-wide settings, each made concrete and predicted.

Phase 1 plans every group alone (every TP and pipeline depth, micro-batch size, recomputation);
its best plan per group is that group's share of the theoretical upper bound, and its best
layouts seed phase 2, which tries the heterogeneous structures (combinations of per-group
layouts, and replicas that cross kinds). Every candidate gets its layers from the exact
partitioner and its micro-batches from the balanced split, and is ranked by the predictor; a plan
that does not fit in memory is never kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hethub.planner.candidates import (
    Layout,
    Structure,
    combinations,
    homogeneous,
    mixed,
    tp_degrees,
)
from hethub.planner.costs import Setting, end_time, layer_cap, layer_time
from hethub.planner.partition import partition_layers, stage_times
from hethub.planner.split import ReplicaTiming, split_micro_batches
from hethub.predictor import Prediction, default_calibration, predict
from hethub.predictor.calibration import Calibration
from hethub.spec.cluster import ClusterSpec
from hethub.spec.model import ModelSpec
from hethub.spec.plan import PipelineLayout, Plan, StageSpec, uniform_layers

MICRO_BATCH_SIZES = (1, 2, 4)
MAX_STAGES = 32  # deeper pipelines only add bubble at any batch a plan can have
KEEP_PER_GROUP = 3  # per group and setting, the best layouts phase 2 combines

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, slots=True)
class Ranked:
    plan: Plan
    prediction: Prediction


@dataclass(slots=True)
class Overflow:
    """The candidate that came closest to fitting, for the error when none fits."""

    over_gb: float
    need_gb: float
    group: str
    accelerator: str
    capacity_gb: float
    summary: str


@dataclass(slots=True)
class SearchResult:
    ranked: list[Ranked]
    """Fitting plans, fastest first (each structure and setting at most once)."""
    group_best: dict[str, Ranked | None]
    """Each group's best plan alone (phase 1): the upper bound's terms."""
    candidates_evaluated: int
    search_time_s: float
    closest: Overflow | None = None
    timed_out: bool = False

    @property
    def best(self) -> Ranked | None:
        return self.ranked[0] if self.ranked else None


@dataclass(slots=True)
class _Search:
    cluster: ClusterSpec
    model: ModelSpec
    model_ref: str
    global_batch: int
    deadline: float
    progress: Progress | None
    evaluated: int = 0
    timed_out: bool = False
    ranked: list[Ranked] = field(default_factory=list)
    closest: Overflow | None = None

    def out_of_time(self) -> bool:
        self.timed_out = self.timed_out or time.perf_counter() > self.deadline
        return self.timed_out


def search(cluster: ClusterSpec, model: ModelSpec, global_batch: int, *, model_ref: str,
           calibration: Calibration | None = None, time_limit_s: float | None = None,
           progress: Progress | None = None) -> SearchResult:
    """The fastest plans for ``model`` at ``global_batch`` sequences per step on ``cluster``."""
    started = time.perf_counter()
    cal = calibration or default_calibration()
    state = _Search(cluster, model, model_ref, global_batch,
                    started + time_limit_s if time_limit_s else float("inf"), progress)
    settings = [Setting(model=model, calibration=cal, micro_batch=b, recompute=r)
                for b in MICRO_BATCH_SIZES if global_batch % b == 0 for r in (False, True)]

    group_best: dict[str, Ranked | None] = {}
    seeds: dict[Setting, dict[str, list[Layout]]] = {s: {} for s in settings}
    for group in cluster.groups:
        jobs = [(setting, (layout,)) for setting in settings for layout in homogeneous(group, model, MAX_STAGES)]
        results = _evaluate(state, jobs, f"group {group.name} alone")
        fitting = [(r, job) for r, job in zip(results, jobs) if r is not None]
        group_best[group.name] = max((r for r, _ in fitting), key=_speed, default=None)
        for setting in settings:
            mine = sorted(((r, job[1][0]) for r, job in fitting if job[0] == setting), key=lambda x: -_speed(x[0]))
            seeds[setting][group.name] = [layout for _, layout in mine[:KEEP_PER_GROUP]]

    if len(cluster.groups) > 1:
        jobs = []
        for setting in settings:
            choices = {name: layouts for name, layouts in seeds[setting].items() if layouts}
            tps = {g.name: sorted({l.slots[0].tp for l in choices.get(g.name, [])}) or tp_degrees(g, model)[-1:]
                   for g in cluster.groups}
            for structure in combinations(choices) + mixed(cluster, model, tps, MAX_STAGES, choices):
                jobs.append((setting, structure))
        _evaluate(state, jobs, "heterogeneous plans")

    state.ranked.sort(key=lambda r: -_speed(r))
    return SearchResult(state.ranked, group_best, state.evaluated, time.perf_counter() - started,
                        state.closest, state.timed_out)


def _speed(ranked: Ranked) -> float:
    return ranked.prediction.tokens_per_s


def _evaluate(state: _Search, jobs: list[tuple[Setting, Structure]], phase: str) -> list[Ranked | None]:
    results: list[Ranked | None] = []
    for done, (setting, structure) in enumerate(jobs):
        if state.out_of_time():
            results.append(None)
            continue
        if state.progress and done % 16 == 0:
            state.progress(phase, done, len(jobs))
        results.append(_materialize(state, setting, structure))
    if state.progress:
        state.progress(phase, len(jobs), len(jobs))
    return results


def _materialize(state: _Search, setting: Setting, structure: Structure) -> Ranked | None:
    """Layers per stage and micro-batches per replica for a structure; its prediction if it fits."""
    model, cluster = state.model, state.cluster
    total = state.global_batch // setting.micro_batch
    replicas = sum(layout.count for layout in structure)
    if replicas == 0 or total < replicas:
        return None
    nominal = max(1, total // replicas)
    splits, timings = [], []
    for layout in structure:
        split, times = _partition(setting, cluster, layout, nominal)
        if split is None:
            _note_overflow(state, setting, structure)
            return None
        bottleneck = max(times)
        splits.append(split)
        timings.append(ReplicaTiming(layout.count, bottleneck, sum(times) - bottleneck))
    shares = split_micro_batches(total, timings)
    if shares is None:
        return None
    pipelines = []
    for layout, split, share in zip(structure, splits, shares):
        stages = tuple(StageSpec(group=slot.group, tp=slot.tp, layers=n) for slot, n in zip(layout.slots, split))
        pipelines += [PipelineLayout(count=count, micro_batches=m, stages=stages) for count, m in share]
    plan = Plan(model=state.model_ref, global_batch=state.global_batch, micro_batch=setting.micro_batch,
                recompute="full" if setting.recompute else "none", schedule=setting.schedule,
                pipelines=tuple(pipelines))
    state.evaluated += 1
    prediction = predict(plan, cluster, model, calibration=setting.calibration)
    if not prediction.fits:
        _note_overflow(state, setting, structure, plan, prediction)
        return None
    ranked = Ranked(plan, prediction)
    state.ranked.append(ranked)
    return ranked


def _partition(setting: Setting, cluster: ClusterSpec, layout: Layout, micro_batches: int):
    """The exact layer split of one layout, and its stages' times per micro-batch."""
    p = len(layout.slots)
    groups = [cluster.group(slot.group) for slot in layout.slots]
    per_layer = [layer_time(setting, g, slot.tp) for g, slot in zip(groups, layout.slots)]
    extra = [end_time(setting, g, slot.tp, s == 0, s == p - 1) for s, (g, slot) in enumerate(zip(groups, layout.slots))]
    caps = [layer_cap(setting, g, slot.tp, s, p, micro_batches) for s, (g, slot) in enumerate(zip(groups, layout.slots))]
    split = partition_layers(setting.model.layers, per_layer, extra, caps, micro_batches)
    if split is None:
        return None, None
    return split, stage_times(split, per_layer, extra)


def _note_overflow(state: _Search, setting: Setting, structure: Structure, plan: Plan | None = None,
                   prediction: Prediction | None = None) -> None:
    """Remember by how much the closest candidate overflows which device."""
    if prediction is None:
        if state.closest is not None and state.ranked:
            return
        pipelines = tuple(PipelineLayout(count=layout.count, micro_batches=max(1, state.global_batch // setting.micro_batch
                                                                                  // sum(l.count for l in structure)),
                                         stages=tuple(StageSpec(group=slot.group, tp=slot.tp, layers=n) for slot, n in
                                                      zip(layout.slots, uniform_layers(state.model.layers, len(layout.slots)))))
                          for layout in structure)
        plan = Plan(model=state.model_ref, global_batch=state.global_batch, micro_batch=setting.micro_batch,
                    recompute="full" if setting.recompute else "none", pipelines=pipelines)
        prediction = predict(plan, state.cluster, state.model, calibration=setting.calibration)
    worst = max(prediction.stages, key=lambda s: s.memory.total_gb - state.cluster.group(s.group).accelerator.memory_gb)
    capacity = state.cluster.group(worst.group).accelerator.memory_gb
    over = worst.memory.total_gb - capacity
    if state.closest is None or over < state.closest.over_gb:
        summary = ", ".join(f"{p.count}x[{'+'.join(f'{s.group}:tp{s.tp}x{s.layers}' for s in p.stages)}]"
                            for p in plan.pipelines)
        state.closest = Overflow(over, worst.memory.total_gb, worst.group, worst.accelerator, capacity,
                                 f"{summary}, micro-batch {plan.micro_batch}, recompute {plan.recompute}")


def upper_bound(result: SearchResult) -> tuple[float, dict[str, float]]:
    """The theoretical upper bound: the sum over groups of each group's best throughput alone."""
    per_group = {name: (ranked.prediction.tokens_per_s if ranked else 0.0) for name, ranked in result.group_best.items()}
    return sum(per_group.values()), per_group
