"""The state of one planner search and its one way to price a plan: every candidate the
search weighs is predicted here (predict_and_keep), kept if it fits, and the closest overflow
remembered for the error when none fits."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hethub.memo import memoized
from hethub.planner.candidates import (
    Structure,
)
from hethub.planner.costs import (
    Setting,
    stage_position,
)
from hethub.predictor import Prediction, predict
from hethub.predictor.calibration import Calibration
from hethub.predictor.memory import fits, headroom_gb
from hethub.predictor.stage import StagePosition
from hethub.profiles.selection import Profiles
from hethub.spec.cluster import ClusterSpec, DeviceGroup
from hethub.spec.model import ModelSpec
from hethub.spec.plan import (
    PipelineLayout,
    Plan,
    Recompute,
    StageSpec,
    uniform_layers,
)
from hethub.spec.schedules import (
    in_flight_micro_batches,
)
from hethub.spec.topology import data_parallel_degrees

UNPLACEABLE_PRICED = (
    200  # when no plan fits, how many unplaceable structures to price for the error
)


Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, slots=True)
class PricedPlan:
    """A candidate plan and the predictor's answer for it: what the search ranks."""

    plan: Plan
    prediction: Prediction


@dataclass(slots=True)
class ClosestMiss:
    """The candidate that came closest to fitting, for the error when none fits."""

    over_gb: float
    need_gb: float
    group: str
    accelerator: str
    capacity_gb: float
    summary: str


@dataclass(slots=True)
class SearchState:
    cluster: ClusterSpec
    model: ModelSpec
    model_ref: str
    global_batch: int
    deadline: float
    progress: Progress | None
    calibration: Calibration
    profiles: Profiles | None = None
    evaluated: int = 0
    timed_out: bool = False
    ranked: list[PricedPlan] = field(default_factory=list)
    closest: ClosestMiss | None = None
    best_time: float = float("inf")
    """The fastest fitting step predicted so far in this phase: the bar a candidate must beat."""
    unplaceable: list[tuple[Setting, Structure]] = field(default_factory=list)
    """Structures whose layers fit no split in memory (for the error when no plan fits)."""
    prune: bool = True
    """Skip the drafts and predictions that bounds show cannot win (False: make every one, for
    the tests that hold the pruning to the same plans)."""
    predicted: dict[Plan, Prediction] = field(default_factory=dict)
    """Every plan predicted, by plan: the local search comes back to plans it has priced (a
    layer moved there and back, a plan of one phase a neighbour in the next)."""

    def out_of_time(self) -> bool:
        self.timed_out = self.timed_out or time.perf_counter() > self.deadline
        return self.timed_out


def plan_speed(ranked: PricedPlan) -> float:
    return ranked.prediction.tokens_per_s


def plan_step_s(ranked: PricedPlan) -> float:
    return ranked.prediction.iteration_time_s


def setting_of(state: SearchState, plan: Plan, recompute: Recompute | None = None) -> Setting:
    """The setting ``plan`` is costed under in ``state``'s search (a stage of it: under its
    own ``recompute``)."""
    return Setting(
        model=state.model,
        calibration=state.calibration,
        micro_batch=plan.micro_batch,
        recompute=recompute or plan.recompute,
        precision=plan.precision,
        sequence_parallel=plan.sequence_parallel,
        profiles=state.profiles,
    )


def plan_fits(state: SearchState, plan: Plan) -> bool:
    """Whether every stage of ``plan`` fits in its devices' memory as predict() finds it: the
    same pricing of the same stage shape, micro-batches in flight and optimizer shards."""
    shards = data_parallel_degrees(plan) if plan.shard_optimizer else [1] * len(plan.pipelines)
    for pipeline, shard in zip(plan.pipelines, shards):
        p, m = len(pipeline.stages), pipeline.micro_batches
        for s, stage in enumerate(pipeline.stages):
            setting = setting_of(state, plan, stage.recompute)
            in_flight = in_flight_micro_batches(pipeline.schedule, s, p, m, stage.chunks)
            group = state.cluster.group(stage.group)
            where = stage_position(pipeline.schedule, s, p)
            if not _stage_fits(
                setting, group, stage.tp, stage.layers, where, in_flight=in_flight, shards=shard
            ):
                return False
    return True


@memoized
def _stage_fits(
    setting: Setting,
    group: DeviceGroup,
    tp: int,
    layers: int,
    position: StagePosition,
    *,
    in_flight: float,
    shards: int,
) -> bool:
    """Whether a stage of ``tp``, ``layers`` at ``position`` under ``setting`` fits its devices
    with ``in_flight`` micro-batches held and its optimizer over ``shards`` ranks."""
    shape = setting.shape(tp, layers, position)
    memory = setting.pricing.memory(group, shape, in_flight=in_flight, optimizer_shards=shards)
    return fits(memory, group.accelerator)


def predict_and_keep(state: SearchState, plan: Plan) -> PricedPlan | None:
    """The plan predicted and kept, if it fits. Once a plan fits, one that plan_fits shows does not
    is not predicted: it would not be kept, and the closest overflow only matters while none
    fits."""
    if state.prune and state.ranked and not plan_fits(state, plan):
        return None
    prediction = state.predicted.get(plan)
    if prediction is None:
        state.evaluated += 1
        prediction = predict(
            plan, state.cluster, state.model, calibration=state.calibration, profiles=state.profiles
        )
        state.predicted[plan] = prediction
    if not prediction.fits:
        note_overflow(state, plan, prediction)
        return None
    ranked = PricedPlan(plan, prediction)
    state.ranked.append(ranked)
    state.best_time = min(state.best_time, prediction.iteration_time_s)
    return ranked


def note_overflow(state: SearchState, plan: Plan, prediction: Prediction) -> None:
    """Remember by how much the closest candidate overflows which device."""

    def over(stage) -> float:
        return -headroom_gb(stage.memory, state.cluster.group(stage.group).accelerator)

    worst = max(prediction.stages, key=over)
    if state.closest is None or over(worst) < state.closest.over_gb:
        summary = ", ".join(
            f"{p.count}x[{'+'.join(f'{s.group}:tp{s.tp}x{s.layers}' for s in p.stages)}]"
            for p in plan.pipelines
        )
        state.closest = ClosestMiss(
            over(worst),
            worst.memory.total_gb,
            worst.group,
            worst.accelerator,
            state.cluster.group(worst.group).accelerator.usable_memory_gb,
            f"{summary}, micro-batch {plan.micro_batch}, recompute {plan.recompute}",
        )


def closest_unplaceable(state: SearchState) -> None:
    """When nothing fits, price the structures the partitioner could not place (layers split
    evenly) to say by how much the closest one overflows."""
    for setting, structure in state.unplaceable[:UNPLACEABLE_PRICED]:
        total = state.global_batch // setting.micro_batch
        each = max(1, total // sum(layout.count for layout in structure))
        pipelines = tuple(
            PipelineLayout(
                count=layout.count,
                micro_batches=each,
                stages=tuple(
                    StageSpec(group=slot.group, tp=slot.tp, layers=n)
                    for slot, n in zip(
                        layout.slots, uniform_layers(state.model.layers, len(layout.slots))
                    )
                ),
            )
            for layout in structure
        )
        plan = Plan(
            model=state.model_ref,
            global_batch=state.global_batch,
            micro_batch=setting.micro_batch,
            recompute=setting.recompute,
            precision=setting.precision,
            pipelines=pipelines,
        )
        note_overflow(
            state,
            plan,
            predict(
                plan,
                state.cluster,
                state.model,
                calibration=setting.calibration,
                profiles=state.profiles,
            ),
        )
