"""What the planner needs to know of a stage before it has layers: time per layer, the embedding's
and the head's extra time, and how many layers fit in memory, all from the predictor's models."""

from __future__ import annotations

from dataclasses import dataclass

from hethub.memo import memoized
from hethub.predictor.calibration import Calibration
from hethub.predictor.memory import headroom_gb
from hethub.predictor.memory import stage_position as _stage_position
from hethub.predictor.pricing import Pricing, pricing_for
from hethub.predictor.stage import MIDDLE, StagePosition, StageShape, StageTimes
from hethub.profiles.selection import Profiles
from hethub.spec.cluster import ClusterSpec, DeviceGroup
from hethub.spec.hashing import hashed_once
from hethub.spec.model import ModelSpec
from hethub.spec.plan import Precision, Recompute
from hethub.spec.schedules import Schedule, in_flight_micro_batches, megatron_in_flight


@dataclass(frozen=True, slots=True)
@hashed_once()  # a key of the planner's caches, inside every layout
class StageSlot:
    """A pipeline stage before its layers are chosen: ``tp`` devices of one group."""

    group: str
    tp: int


@dataclass(frozen=True, slots=True)
@hashed_once()
class Setting:
    """The plan-wide choices a candidate is costed under."""

    model: ModelSpec
    calibration: Calibration
    micro_batch: int
    recompute: Recompute
    precision: Precision
    schedule: Schedule = Schedule.ONE_F_ONE_B
    sequence_parallel: bool = False
    """Sequence parallelism on the stages of more than one device (the plan's field)."""
    profiles: Profiles | None = None
    """Measured profiles under the job's run conditions (None: the analytic model alone)."""

    @property
    def pricing(self) -> Pricing:
        """Where its costs come from: its profiles where they hold them, else the analytic
        model."""
        return pricing_for(self.calibration, self.profiles)

    def shape(self, tp: int, layers: int, position: StagePosition) -> StageShape:
        """A stage of ``layers`` layers on ``tp`` devices at ``position``, under this setting."""
        return StageShape(
            model=self.model,
            layers=layers,
            tp=tp,
            position=position,
            micro_batch=self.micro_batch,
            recompute=self.recompute,
            precision=self.precision,
            sequence_parallel=self.sequence_parallel,
        )


stage_position = memoized(_stage_position)
"""predictor.memory.stage_position, cached: the planner asks it for every stage of every
structure it weighs (a few hundred distinct answers)."""

ZBV_SATURATED = 2
"""Under ZBV (two equal chunks a stage) every stage's micro-batches in flight stop growing once
there are this many times the stages: its peak is in the warm-up, which 2p micro-batches fill
(tests/test_planner_shortcuts.py holds it against the walk of the order)."""


@memoized
def layer_time(setting: Setting, group: DeviceGroup, tp: int) -> float:
    """Forward plus backward of one layer, one micro-batch, on a stage of ``tp`` devices of
    ``group``."""
    forward, backward = _work(setting, group, tp, 1, MIDDLE)
    return forward + backward


@memoized
def end_time(setting: Setting, group: DeviceGroup, tp: int, position: StagePosition) -> float:
    """Forward plus backward of the embedding (first stage) and the head (last stage)."""
    forward, backward = _work(setting, group, tp, 0, position)
    return forward + backward


def _work(
    setting: Setting, group: DeviceGroup, tp: int, layers: int, position: StagePosition
) -> StageTimes:
    return setting.pricing.work(group, setting.shape(tp, layers, position))


def stage_caps(
    setting: Setting,
    cluster: ClusterSpec,
    slots: tuple[StageSlot, ...],
    micro_batches: int,
    chunks: int = 1,
    shards: int = 1,
) -> tuple[int, ...]:
    """The most layers each stage of a pipeline over ``slots`` can hold in its devices' memory,
    in ``chunks`` chunks of about equal size (interleaved 1F1B), its optimizer state split over
    ``shards`` ranks."""
    p = len(slots)
    if setting.schedule == Schedule.ZBV:  # walking the V's order is dear; beyond 2p, the same
        micro_batches = min(micro_batches, ZBV_SATURATED * p)
    if chunks == 1 or setting.schedule != Schedule.INTERLEAVED_1F1B:  # ZBV: its two chunks
        in_flight = tuple(
            in_flight_micro_batches(setting.schedule, s, p, micro_batches) for s in range(p)
        )
    else:
        # Interleaved: the schedule's own warm-up for equal chunks (megatron_in_flight, the
        # walk's closed form at any micro-batch count). Walking the exact, unequal chunks
        # (in_flight_micro_batches) would build a schedule order for every draft, for a draft
        # whose micro-batches are nominal anyway (the split comes after); the prediction of a
        # candidate checks its memory on the exact order.
        in_flight = tuple(megatron_in_flight(s, p, micro_batches, chunks) for s in range(p))
    # Keyed on what the caps depend on: the micro-batches in flight, the same for every count
    # of micro-batches beyond the stages (a planner asks for many).
    return _stage_caps(setting, cluster, slots, in_flight, shards)


@memoized
def _stage_caps(
    setting: Setting,
    cluster: ClusterSpec,
    slots: tuple[StageSlot, ...],
    in_flight: tuple[float, ...],
    shards: int,
) -> tuple[int, ...]:
    p = len(slots)
    return tuple(
        _layer_cap(
            setting,
            cluster.group(slot.group),
            slot.tp,
            stage_position(setting.schedule, s, p),
            held,
            shards,
        )
        for s, (slot, held) in enumerate(zip(slots, in_flight))
    )


@memoized
def _layer_cap(
    setting: Setting,
    group: DeviceGroup,
    tp: int,
    position: StagePosition,
    in_flight: float,
    shards: int,
) -> int:
    def gb(layers: int) -> float:
        shape = setting.shape(tp, layers, position)
        memory = setting.pricing.memory(group, shape, in_flight=in_flight, optimizer_shards=shards)
        return memory.total_gb

    fixed = gb(0)
    per_layer = gb(1) - fixed  # memory is linear in the layers
    room = headroom_gb(fixed, group.accelerator)
    if room < per_layer:
        return 0
    return min(setting.model.layers, int(room / per_layer + 1e-9))
