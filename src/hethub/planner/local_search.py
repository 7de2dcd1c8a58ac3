"""The local search that polishes a phase's best plans: one layer moved across a stage
boundary, one stage's recomputation dropped, the optimizer unsharded or sequence parallelism
off, each judged by the predictor itself."""

from __future__ import annotations

import dataclasses

from hethub.planner.floors import compute_floor
from hethub.planner.search_state import (
    PricedPlan,
    SearchState,
    plan_speed,
    plan_step_s,
    predict_and_keep,
)
from hethub.spec.plan import (
    PipelineLayout,
    Plan,
    Recompute,
    StageSpec,
    stage_chunk_layers,
)

REFINE_BUDGET = 300  # predictions a phase may spend polishing its best plans


REFINE_ROUNDS = 6


def refine_best(state: SearchState, found: list[PricedPlan]) -> PricedPlan | None:
    """Polish a phase's plans, best first (each setting's best early on), by moving single layers
    across stage boundaries, judged by the predictor itself: the partitioner's objective leaves
    out communication, gradient sync and the optimizer step, which matter for short steps.
    Returns the phase's best plan.

    A neighbour that cannot replace the plan, as its step takes at least as long
    (compute_floor) or it does not fit in memory (predict_and_keep: most moves of a layer onto
    a stage that memory already bounds), is not predicted; it still counts against the budget,
    so the same plans are polished as far as if it were."""
    found = sorted(found, key=plan_speed, reverse=True)
    best_per_setting = {}
    for ranked in found:
        best_per_setting.setdefault((ranked.plan.micro_batch, ranked.plan.recompute), ranked)
    tried = 0  # neighbours weighed, predicted or not: the budget
    polished = []
    for ranked in dict.fromkeys([*found[:1], *best_per_setting.values(), *found]):
        best = ranked
        for _ in range(REFINE_ROUNDS):
            improved = False
            for plan in _neighbours(best.plan):
                if tried >= REFINE_BUDGET or state.out_of_time():
                    break
                tried += 1
                if state.prune and compute_floor(state, plan) >= plan_step_s(best):
                    continue
                candidate = predict_and_keep(state, plan)
                if candidate is not None and plan_speed(candidate) > plan_speed(best):
                    best, improved = candidate, True
            if not improved:
                break
        polished.append(best)
        if tried >= REFINE_BUDGET or state.out_of_time():
            break
    return max([*found, *polished], key=plan_speed, default=None)


def _neighbours(plan: Plan):
    """The plans one step from ``plan``: one layer moved (_layer_moves), or its optimizer
    unsharded (a sharded optimizer's all-gather of the updated weights follows its step, where
    an overlapped all-reduce may have hidden the whole sync; unsharded, it may not fit)."""
    if plan.shard_optimizer:  # first: one candidate, which a spent budget must not skip
        yield dataclasses.replace(plan, shard_optimizer=False, overlap_param_gather=False)
    yield from _recompute_dropped(plan)
    if plan.sequence_parallel:  # it saves memory; its edges' gathers may cost more
        yield dataclasses.replace(plan, sequence_parallel=False)
    yield from _layer_moves(plan)


def _recompute_dropped(plan: Plan):
    """The plan with one recomputing stage recomputing nothing, in every layout holding it, the
    last stages first (they hold the fewest micro-batches in flight, so the likeliest to fit):
    recomputation where memory is short, and only there."""
    for layout in _layouts(plan):
        stages = layout.stages
        for s in reversed(range(len(stages))):
            if stages[s].recompute == Recompute.NONE:
                continue
            changed = tuple(
                dataclasses.replace(st, recompute=Recompute.NONE) if i == s else st
                for i, st in enumerate(stages)
            )
            yield _restaged(plan, layout, changed)


def _layer_moves(plan: Plan):
    """Plans with one layer moved to a neighbouring chunk of the model (a neighbouring stage
    without interleaving), in every layout (replicas that share stages move together, since they
    sync as one)."""
    for layout in _layouts(plan):
        stages, chunk_layers = layout.stages, layout.chunk_layers()
        for g in range(len(chunk_layers) - 1):
            for donor, taker in ((g, g + 1), (g + 1, g)):
                if chunk_layers[donor] == 1:
                    continue
                moved = list(chunk_layers)
                moved[donor] -= 1
                moved[taker] += 1
                split = stage_chunk_layers(layout.schedule, moved, len(stages))
                changed = tuple(
                    StageSpec.of_chunks(st.group, st.tp, chunks, st.recompute)
                    for st, chunks in zip(stages, split)
                )
                yield _restaged(plan, layout, changed)


def _layouts(plan: Plan) -> list[PipelineLayout]:
    """The plan's distinct layouts (stages and schedule), in order: the replicas of one change
    together, since they sync as one."""
    first: dict[tuple, PipelineLayout] = {}
    for pipeline in plan.pipelines:
        first.setdefault((pipeline.stages, pipeline.schedule), pipeline)
    return list(first.values())


def _restaged(plan: Plan, layout: PipelineLayout, stages: tuple[StageSpec, ...]) -> Plan:
    """``plan`` with every pipeline of ``layout``'s stages and schedule holding ``stages``."""
    key = (layout.stages, layout.schedule)
    return dataclasses.replace(
        plan,
        pipelines=tuple(
            dataclasses.replace(pl, stages=stages) if (pl.stages, pl.schedule) == key else pl
            for pl in plan.pipelines
        ),
    )
