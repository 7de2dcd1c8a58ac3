"""The pipeline schedule simulation: closed forms, exactness of the steady-state jump, order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hethub.predictor.schedule import (
    BACKWARD,
    FORWARD,
    schedule_order,
    simulate,
    stage_end_times,
    stage_sequence,
)

durations = st.floats(min_value=0.01, max_value=10.0, allow_nan=False)


def _draw_stages(data, p):
    """Random forward and backward times of p stages, and the sends between them."""
    f = data.draw(st.lists(durations, min_size=p, max_size=p))
    b = data.draw(st.lists(durations, min_size=p, max_size=p))
    return f, b, data.draw(st.lists(st.floats(0, 1), min_size=p - 1, max_size=p - 1))


@settings(max_examples=200, deadline=None)
@given(
    p=st.integers(1, 12),
    m=st.integers(1, 64),
    f=durations,
    b=durations,
    schedule=st.sampled_from(["1f1b", "gpipe"]),
)
def test_uniform_stages_without_communication_match_the_closed_form(p, m, f, b, schedule):
    order = schedule_order(schedule, p, m)
    end = simulate(order, [f] * p, [b] * p, [0.0] * (p - 1), [0.0] * (p - 1))
    assert max(end[i] for i in order.last_op) == pytest.approx((m + p - 1) * (f + b), rel=1e-12)


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    p=st.integers(1, 10),
    m=st.integers(1, 48),
    schedule=st.sampled_from(["1f1b", "gpipe"]),
)
def test_jumping_over_the_steady_state_is_exact(data, p, m, schedule):
    f, b, sends = _draw_stages(data, p)
    order = schedule_order(schedule, p, m)
    fast = simulate(order, f, b, sends, sends)
    full = simulate(order, f, b, sends, sends, every_op=True)
    for i in order.last_op:
        assert fast[i] == pytest.approx(full[i], rel=1e-12)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,m", [(1, 1), (3, 2), (4, 8), (5, 5), (8, 3)])
def test_order_puts_every_dependency_first_and_runs_each_stage_in_sequence(schedule, p, m):
    order = schedule_order(schedule, p, m)
    assert len(order.ops) == 2 * p * m
    for i, (prev, dep, _, _) in enumerate(order.steps):
        assert prev < i and dep < i
    for s in range(p):
        ran = [(kind, j) for (stage, kind, j) in order.ops if stage == s]
        assert ran == stage_sequence(schedule, s, p, m)


def test_1f1b_keeps_at_most_stages_minus_position_micro_batches_in_flight():
    p, m = 4, 10
    for s in range(p):
        in_flight = peak = 0
        for kind, _ in stage_sequence("1f1b", s, p, m):
            in_flight += 1 if kind == FORWARD else -1
            peak = max(peak, in_flight)
        assert peak == p - s


def test_a_send_delays_the_next_stage():
    order = schedule_order("1f1b", 2, 1)
    end = simulate(order, [1.0, 1.0], [2.0, 2.0], [0.5], [0.25])
    # F0 on stage 0 ends at 1, arrives at 1.5, F0 on stage 1 ends 2.5, B0 ends 4.5, arrives 4.75,
    # B0 ends 6.75.
    assert max(end) == pytest.approx(6.75)


def test_bottleneck_stage_sets_the_steady_state():
    p, m = 4, 32
    f = [1.0, 1.0, 3.0, 1.0]
    b = [2.0, 2.0, 6.0, 2.0]
    order = schedule_order("1f1b", p, m)
    end = simulate(order, f, b, [0.0] * 3, [0.0] * 3)
    total = max(end[i] for i in order.last_op)
    assert total >= m * 9.0  # the slow stage is busy for m x (3 + 6)
    assert total <= m * 9.0 + sum(f) + sum(b)  # plus at most one pass through the others
    assert BACKWARD == 1


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    p=st.integers(1, 6),
    m=st.integers(1, 120),
    schedule=st.sampled_from(["1f1b", "gpipe"]),
)
def test_stage_end_times_of_a_long_schedule_equal_the_full_simulation(data, p, m, schedule):
    f, b, sends = _draw_stages(data, p)
    order = schedule_order(schedule, p, m)
    full = simulate(order, f, b, sends, sends, every_op=True)
    expected = [full[i] for i in order.last_op]
    assert stage_end_times(schedule, f, b, sends, sends, m) == pytest.approx(expected, rel=1e-9)
