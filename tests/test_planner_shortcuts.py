"""The predictor's shortcuts that the planner's speed rests on give exactly what they replace."""

from __future__ import annotations

import gc
import random

import pytest

from hethub.planner.costs import ZBV_SATURATED
from hethub.predictor.schedule import FORWARD, collector_paused, schedule_order, simulate
from hethub.spec.schedules import Schedule, peak_in_flight


@pytest.mark.parametrize(
    ("schedule", "stages", "micro_batches", "chunks"),
    [
        (Schedule.ONE_F_ONE_B, 4, 9, 1),
        (Schedule.GPIPE, 3, 5, 1),
        (Schedule.INTERLEAVED_1F1B, 3, 7, 2),
        (Schedule.ZB_H1, 4, 6, 1),
        (Schedule.ZBV, 3, 5, 2),
    ],
)
def test_last_gradient_op_ends_when_the_chunk_is_done(schedule, stages, micro_batches, chunks):
    """Per model chunk, the op ScheduleOrder names ends exactly when the latest of the chunk's
    backwards and W's ends, on random unequal costs (the latest, found by looking at all)."""
    order = schedule_order(schedule, stages, micro_batches, chunks)
    rng = random.Random(7)
    n = stages * chunks
    costs = [[rng.uniform(0.1, 2.0) for _ in range(n)] for _ in range(3)]
    sends = [[rng.uniform(0.0, 0.3) for _ in range(n - 1)] for _ in range(2)]
    weight = costs[2] if schedule.splits_backward else None
    end = simulate(order, costs[0], costs[1], *sends, weight_s=weight, every_op=True)
    latest = [0.0] * n
    seen = [0] * n
    for i, ((_, kind, _), finish) in enumerate(zip(order.ops, end)):
        if kind != FORWARD:
            latest[order.chunk_of(i)] = max(latest[order.chunk_of(i)], finish)
            seen[order.chunk_of(i)] += 1
    assert all(seen)
    assert [end[i] for i in order.last_gradient_op] == latest


@pytest.mark.parametrize("stages", [1, 2, 3, 5, 8, 13])
def test_zbv_in_flight_stops_growing_at_twice_the_stages(stages):
    """planner.costs caps ZBV's micro-batches at ZBV_SATURATED x p before asking the walk of the
    order for the micro-batches in flight: every stage's peak is the same at any count beyond."""
    saturated = ZBV_SATURATED * stages
    for s in range(stages):
        at_saturation = peak_in_flight(Schedule.ZBV, s, stages, saturated, (1, 1))
        for m in (saturated + 1, saturated + 2, saturated + 7, 3 * saturated + 1, 5 * saturated):
            assert peak_in_flight(Schedule.ZBV, s, stages, m, (1, 1)) == at_saturation
    # below it, the count matters: the first stage holds fewer at p micro-batches
    first = [peak_in_flight(Schedule.ZBV, 0, stages, m, (1, 1)) for m in (stages, saturated)]
    assert stages == 1 or first[0] < first[1]


def test_collector_paused_restores_what_it_found():
    """The search pauses Python's cycle collector: it is off inside, nested or not, and after
    it is back as it was (on, or off where the caller had turned it off)."""
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
