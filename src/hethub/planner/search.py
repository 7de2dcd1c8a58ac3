"""The planner's search: structures x plan-wide settings, each made concrete and predicted.

Phase 1 plans every group alone with the whole batch (every TP and pipeline depth, micro-batch
size, recomputation); its best layouts seed phase 2, which tries the heterogeneous structures
(combinations of per-group layouts, and replicas that cross kinds); phase 3 cuts, for two kinds,
each group's share of a replica into stages of two neighbouring TP degrees, under the best plan's
setting. Every candidate gets its layers from the exact partitioner and its micro-batches from the
balanced split, is predicted only if it can beat the best so far, and each phase's best plans are
polished by moving single layers; a plan that does not fit in memory is never kept.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from hethub.memo import memo_scope
from hethub.planner.candidates import (
    Layout,
    combinations,
    homogeneous,
    mixed,
    mixed_tp,
    tp_degrees,
)
from hethub.planner.costs import (
    Setting,
)
from hethub.planner.drafts import evaluate_jobs
from hethub.planner.local_search import refine_best
from hethub.planner.search_state import (
    ClosestMiss,
    PricedPlan,
    Progress,
    SearchState,
    closest_unplaceable,
    plan_speed,
)
from hethub.predictor import default_calibration
from hethub.predictor.calibration import Calibration
from hethub.predictor.iteration import check_precision
from hethub.predictor.profiled import for_precision
from hethub.profiles.selection import Profiles
from hethub.spec.cluster import ClusterSpec
from hethub.spec.model import ModelSpec
from hethub.spec.plan import (
    Precision,
    Recompute,
)

MICRO_BATCH_SIZES = (1, 2, 4)


MAX_STAGES = 32  # deeper pipelines only add bubble at any batch a plan can have


KEEP_PER_GROUP = 3  # per group and setting, the best layouts phase 2 combines


SEARCHED_RECOMPUTE = (Recompute.NONE, Recompute.FULL)
"""The recomputations the search tries, each for a whole plan: selective, which saves only the
attention kernel's log-sum-exp with flash kernels (spec.layer_ops), would price half as many
plans again for next to no memory; the local search drops a stage's recomputation where it
fits without."""


@dataclass(frozen=True, slots=True)
class SearchQuery:
    """What a search was asked: planner.bound plans each group alone under the same options."""

    cluster: ClusterSpec
    model: ModelSpec
    global_batch: int
    model_ref: str
    calibration: Calibration
    profiles: Profiles | None
    """Already selected for ``precision``."""
    precision: Precision
    prune: bool = True


@dataclass(slots=True)
class SearchResult:
    ranked: list[PricedPlan]
    """Fitting plans, fastest first (each structure and setting at most once)."""
    group_best: dict[str, PricedPlan | None]
    """Each group's best plan alone with the whole global batch (phase 1)."""
    candidates_evaluated: int
    search_time_s: float
    query: SearchQuery
    closest: ClosestMiss | None = None
    timed_out: bool = False

    @property
    def best(self) -> PricedPlan | None:
        return self.ranked[0] if self.ranked else None


@memo_scope()  # shared by every plan the search prices, gone when it returns
def search(
    cluster: ClusterSpec,
    model: ModelSpec,
    global_batch: int,
    *,
    model_ref: str,
    calibration: Calibration | None = None,
    time_limit_s: float | None = None,
    progress: Progress | None = None,
    profiles: Profiles | None = None,
    precision: Precision = Precision.BF16,
    prune: bool = True,
) -> SearchResult:
    """The fastest plans for ``model`` at ``global_batch`` sequences per step on ``cluster``, all
    of ``precision``; ``profiles`` (selected under the job's run conditions) price what they hold
    of that precision's dtype, as in predict(). ``prune`` False drafts and predicts every
    candidate that the bounds would skip as unable to win: the same plans, slower (for tests)."""
    started = time.perf_counter()
    cal = calibration or default_calibration()
    precision = Precision(precision)
    check_precision(cluster, precision)
    if profiles is not None:
        profiles = for_precision(profiles, precision)
    state = SearchState(
        cluster,
        model,
        model_ref,
        global_batch,
        started + time_limit_s if time_limit_s else float("inf"),
        progress,
        cal,
        profiles,
        prune=prune,
    )
    settings = _settings(state, precision)
    group_best, seeds = _groups_alone(state, settings)
    if len(cluster.groups) > 1:
        _mixes(state, settings, group_best, seeds)
    if not state.ranked and state.closest is None:
        closest_unplaceable(state)
    state.ranked.sort(key=lambda r: -plan_speed(r))
    return SearchResult(
        state.ranked,
        group_best,
        state.evaluated,
        time.perf_counter() - started,
        SearchQuery(cluster, model, global_batch, model_ref, cal, profiles, precision, prune),
        state.closest,
        state.timed_out,
    )


def _settings(state: SearchState, precision: Precision) -> list[Setting]:
    """The plan-wide settings the search tries: every micro-batch size that divides the batch,
    under each searched recomputation. Sequence parallelism wherever a stage has TP (as every
    Megatron-LM recipe at scale): less memory for the same communication; the local search
    tries each best plan without it. Profiles measure layers without it, so a profiled search
    leaves it off."""
    model, cluster = state.model, state.cluster
    sequence_parallel = state.profiles is None and all(
        model.seq_len % tp == 0 for g in cluster.groups for tp in tp_degrees(g, model)
    )
    return [
        Setting(
            model=model,
            calibration=state.calibration,
            micro_batch=b,
            recompute=r,
            profiles=state.profiles,
            precision=precision,
            sequence_parallel=sequence_parallel,
        )
        for b in MICRO_BATCH_SIZES
        if state.global_batch % b == 0
        for r in SEARCHED_RECOMPUTE
    ]


def _groups_alone(
    state: SearchState, settings: list[Setting]
) -> tuple[dict[str, PricedPlan | None], dict[Setting, dict[str, list[Layout]]]]:
    """Phase 1: each group alone with the whole batch. Returns each group's best plan and, per
    setting, each group's best layouts (the seeds of phase 2)."""
    group_best: dict[str, PricedPlan | None] = {}
    seeds: dict[Setting, dict[str, list[Layout]]] = {s: {} for s in settings}
    for group in state.cluster.groups:
        # Each group is searched exactly as a cluster of that group alone would be: the same jobs,
        # the same bar, so planner.bound may take its best here as the group alone at this batch.
        state.best_time = float("inf")
        jobs = [
            (setting, (layout,))
            for setting in settings
            for layout in homogeneous(group, state.model, MAX_STAGES)
        ]
        fitting = [(r, jobs[i]) for r, i in evaluate_jobs(state, jobs, f"group {group.name} alone")]
        group_best[group.name] = refine_best(state, [r for r, _ in fitting])
        for setting in settings:
            mine = sorted(
                ((r, job[1][0]) for r, job in fitting if job[0] == setting),
                key=lambda x: -plan_speed(x[0]),
            )
            best_layouts = dict.fromkeys(layout for _, layout in mine)  # interleaved or not
            seeds[setting][group.name] = list(best_layouts)[:KEEP_PER_GROUP]
    return group_best, seeds


def _mixes(
    state: SearchState,
    settings: list[Setting],
    group_best: dict[str, PricedPlan | None],
    seeds: dict[Setting, dict[str, list[Layout]]],
) -> None:
    """Phases 2 and 3: the heterogeneous structures (combinations of the groups' best layouts,
    and replicas that cross kinds), then, under the best plan's setting, finer mixes of TP
    degrees; their fitting plans join ``state.ranked``."""
    cluster, model = state.cluster, state.model
    state.best_time = min(
        (r.prediction.iteration_time_s for r in group_best.values() if r), default=float("inf")
    )
    jobs = []
    # A setting under which a group had nothing predicted (its bar came from a better
    # setting) still mixes the group's best layouts of the other settings.
    anywhere = {
        g.name: list(dict.fromkeys(x for s in settings for x in seeds[s].get(g.name, [])))
        for g in cluster.groups
    }
    for setting in settings:
        choices = {
            name: layouts or anywhere[name][:KEEP_PER_GROUP]
            for name, layouts in seeds[setting].items()
        }
        choices = {name: layouts for name, layouts in choices.items() if layouts}
        if not choices:
            continue  # no group came near its best alone under this setting: nor will a mix
        tps = _mixed_tps(cluster, model, choices)
        for structure in combinations(choices) + mixed(cluster, model, tps, MAX_STAGES, choices):
            jobs.append((setting, structure))
    found = [r for r, _ in evaluate_jobs(state, jobs, "heterogeneous plans")]
    best = refine_best(state, found)
    if best is not None:  # finer mixes of TP degrees, under the best plan's setting
        setting = next(
            s
            for s in settings
            if s.micro_batch == best.plan.micro_batch and s.recompute == best.plan.recompute
        )
        jobs = [(setting, structure) for structure in mixed_tp(cluster, model, MAX_STAGES)]
        refine_best(state, [r for r, _ in evaluate_jobs(state, jobs, "mixed TP degrees")])


def _mixed_tps(
    cluster: ClusterSpec, model: ModelSpec, choices: dict[str, list[Layout]]
) -> dict[str, list[int]]:
    """TP degrees per group for pipelines that cross kinds: every degree for two groups; for three,
    those of the group's best layouts alone and its widest (fewest stages); beyond, only its best
    (the mixes multiply past any budget otherwise)."""
    out = {}
    for g in cluster.groups:
        every, best = (
            tp_degrees(g, model),
            [layout.slots[0].tp for layout in choices.get(g.name, [])],
        )
        if len(cluster.groups) <= 2:
            out[g.name] = every
        elif len(cluster.groups) == 3:
            out[g.name] = sorted(set(best) | {every[-1]})
        else:
            out[g.name] = best[:1] or every[-1:]
    return out
