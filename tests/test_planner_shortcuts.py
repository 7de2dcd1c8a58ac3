"""The predictor's shortcuts that the planner's speed rests on give exactly what they replace."""

from __future__ import annotations

import random

import pytest

from hethub.predictor.schedule import FORWARD, schedule_order, simulate
from hethub.spec.schedules import Schedule


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
