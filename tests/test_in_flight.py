"""Micro-batches in flight have one definition, the walk of spec.schedules' own order
(peak_in_flight); its closed forms are shortcuts only where they equal the walk, and the
planner's Megatron-LM warm-up estimate never exceeds it."""

from __future__ import annotations

import pytest

from hethub.spec.schedules import (
    BACKWARD,
    FORWARD,
    Schedule,
    chunks_per_stage,
    in_flight_micro_batches,
    interleaved_orders,
    megatron_in_flight,
    peak_in_flight,
    run_in_dependency_order,
)


@pytest.mark.parametrize("schedule", [s for s in Schedule if chunks_per_stage(s) != 2])
def test_one_chunk_s_closed_form_is_the_walk(schedule: Schedule) -> None:
    for p in range(1, 13):
        for m in range(1, 3 * p + 2):
            for s in range(p):
                for layers in (1, 3):
                    walked = peak_in_flight(schedule, s, p, m, (layers,))
                    assert in_flight_micro_batches(schedule, s, p, m, (layers,)) == walked


def test_equal_chunks_closed_form_is_the_walk_at_any_micro_batch_count() -> None:
    for p in range(2, 17):
        for v in (2, 3, 4):
            counts = {*range(1, 3 * p + 2), 8 * p if p <= 8 else 4 * p}
            for m in sorted(counts):
                for s in range(p):
                    for layers in (1, 2):
                        walked = peak_in_flight(Schedule.INTERLEAVED_1F1B, s, p, m, (layers,) * v)
                        shortcut = in_flight_micro_batches(
                            Schedule.INTERLEAVED_1F1B, s, p, m, (layers,) * v
                        )
                        assert shortcut == walked == megatron_in_flight(s, p, m, v), (p, v, m, s)


def test_unequal_chunks_are_walked_and_a_larger_first_group_holds_more():
    for p in range(2, 9):
        for v in (2, 3, 4):
            for m in range(1, 3 * p + 1):
                for s in range(p):
                    unequal = (1,) * (v - 1) + (3,)
                    assert in_flight_micro_batches(
                        Schedule.INTERLEAVED_1F1B, s, p, m, unequal
                    ) == peak_in_flight(Schedule.INTERLEAVED_1F1B, s, p, m, unequal)
    # 9 micro-batches over 4 stages are groups of 5 and 4: the last stage runs (3 - 1) x 5
    # chunk forwards before its first backward, two more than groups of 4 (8 micro-batches)
    assert megatron_in_flight(3, 4, 9, 3) == pytest.approx(11 / 3)
    assert megatron_in_flight(3, 4, 8, 3) == 3


def test_the_walk_counts_what_the_order_holds_by_hand() -> None:
    # stage 0 of 2, 2 chunks of 1 and 3 layers, 2 micro-batches: its order, and what it holds
    order = interleaved_orders(2, 2, 2)[0]
    held = peak = 0
    for kind, chunk, _ in order:
        held += (1, 3)[chunk] * (1 if kind == FORWARD else -1)
        peak = max(peak, held)
    assert peak_in_flight("interleaved-1f1b", 0, 2, 2, (1, 3)) == peak / 4


def test_the_dependency_walk_runs_every_operation_once_with_its_inputs_first() -> None:
    for p, v, m in [(2, 2, 3), (4, 2, 8), (8, 2, 10), (5, 3, 7)]:
        orders = interleaved_orders(p, v, m)
        ran: list[tuple[int, int, int, int]] = []
        assert run_in_dependency_order(orders, p, v, m, ran) == [len(o) for o in orders]
        assert len(ran) == len(set(ran)) == 2 * p * v * m
        seen = set()
        for s, kind, chunk, j in ran:
            g = chunk * p + s
            if kind == FORWARD and g > 0:
                assert (FORWARD, g - 1, j) in seen
            if kind == BACKWARD:
                assert (FORWARD, g, j) in seen
                assert g == p * v - 1 or (BACKWARD, g + 1, j) in seen
            seen.add((kind, g, j))
