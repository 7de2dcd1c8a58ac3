"""Interleaved 1F1B (spec.schedules.interleaved_sequence) run as a whole pipeline: every stage's
operations in its own order, each waiting for what it depends on (the previous chunk's forward,
the next chunk's backward, its own forward), sends never blocking (the runtime's isend). Every
operation runs exactly once, and no order deadlocks, for p up to 8 stages, v up to 4 chunks,
any micro-batch count from 1 to 3 p, with non-uniform chunk costs; at uniform costs the bubble is
the ideal (p - 1) / (v m) of the work at every micro-batch count m >= p, multiple of p or not."""

from __future__ import annotations

import random

import pytest
from test_zero_bubble import run_pipeline as run_schedule

from hethub.spec.schedules import (
    BACKWARD,
    FORWARD,
    Schedule,
    interleaved_sequence,
    interleaved_warmup,
    micro_batch_groups,
    stage_sequence,
)


def run_pipeline(p: int, v: int, m: int, cost) -> float:
    """Simulate the whole interleaved pipeline (test_zero_bubble's independent walk of every
    schedule); the time its last operation ends. Fails on a deadlock."""
    return run_schedule(Schedule.INTERLEAVED_1F1B, p, m, cost, chunks=v)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("v", [1, 2, 3, 4])
def test_every_operation_runs_once_in_dependency_order_without_deadlock(p, v):
    rng = random.Random(p * 10 + v)
    costs = {(k, g): rng.uniform(0.2, 3.0) for k in (FORWARD, BACKWARD) for g in range(p * v)}
    for m in range(1, 3 * p + 1):
        run_pipeline(p, v, m, lambda kind, g: costs[kind, g])


def test_one_chunk_is_plain_1f1b():
    for p in range(1, 9):
        for m in range(1, 3 * p + 1):
            for s in range(p):
                plain = stage_sequence("1f1b", s, p, m)
                assert [(k, j) for k, _, j in interleaved_sequence(s, p, 1, m)] == plain
                assert {c for _, c, _ in interleaved_sequence(s, p, 1, m)} == {0}


def test_interleaving_shrinks_the_bubble_of_uniform_stages_about_v_fold():
    # p stages, each chunk's forward f / v and backward 2 f / v: the work per stage is the same
    # for any v, and the bubble, (p - 1)(f + b) / v in the ideal, shrinks with v.
    p, m = 4, 8
    work = m * 3.0
    bubbles = []
    for v in (1, 2, 4):
        end = run_pipeline(p, v, m, lambda kind, g, v=v: (1.0 if kind == FORWARD else 2.0) / v)
        bubbles.append(end - work)
    assert bubbles[0] == pytest.approx((p - 1) * 3.0)
    assert bubbles[1] < 0.6 * bubbles[0] and bubbles[2] < 0.6 * bubbles[1]


def test_full_groups_keep_megatron_lms_warm_up():
    # Micro-batches in whole groups of p: each stage starts with Megatron-LM's
    # 2 (p - s - 1) + (v - 1) p forwards.
    for p in (2, 4, 8):
        for v in (2, 3, 4):
            for m in (p, 2 * p):
                for s in range(p):
                    ops = interleaved_sequence(s, p, v, m)
                    leading = next(i for i, (kind, _, _) in enumerate(ops) if kind == BACKWARD)
                    warmup = min(2 * (p - s - 1) + (v - 1) * p, m * v)
                    assert interleaved_warmup(s, p, v, m) == warmup
                    # the steady state opens with one more forward, if any is left
                    assert leading == warmup + (warmup < m * v)


def test_groups_hold_at_least_p_micro_batches_the_larger_first():
    assert micro_batch_groups(9, 31) == [11, 10, 10]
    assert micro_batch_groups(9, 17) == [17]
    assert micro_batch_groups(8, 5) == [5]
    for p in range(1, 10):
        for m in range(p, 5 * p):
            groups = micro_batch_groups(p, m)
            assert sum(groups) == m and min(groups) >= p
            assert groups == sorted(groups, reverse=True) and groups[0] - groups[-1] <= 1


def _uniform_bubble(p: int, v: int, m: int, forward: float, backward: float) -> float:
    """Idle time of the pipeline over its work, every chunk's forward ``forward`` / v and
    backward ``backward`` / v (a stage's work per micro-batch the same for any v)."""
    end = run_pipeline(p, v, m, lambda kind, g: (forward if kind == FORWARD else backward) / v)
    work = m * (forward + backward)
    return (end - work) / work


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_the_bubble_is_the_ideal_at_every_micro_batch_count(p, v):
    # The pipeline fills and drains once, (p - 1) chunk passes each way: (p - 1) / (v m) of the
    # work, what a multiple of p gives, and no more where m is not one.
    for m in range(p, 3 * p + 1):
        for forward, backward in ((1.0, 2.0), (1.0, 1.0)):
            bubble = _uniform_bubble(p, v, m, forward, backward)
            assert bubble == pytest.approx((p - 1) / (v * m), rel=1e-9), (m, forward, backward)


def test_nine_stages_of_seven_chunks_have_no_cliff_between_multiples():
    # issue 28's table: 31 and 32 micro-batches had bubbles of 46% and 20% (of the step)
    # where 27 and 36 had 6% and 5%
    bubbles = {m: _uniform_bubble(9, 7, m, 1.0, 2.0) for m in (27, 31, 32, 36)}
    assert bubbles[27] > bubbles[31] > bubbles[32] > bubbles[36]
    for m, bubble in bubbles.items():
        assert bubble == pytest.approx(8 / (7 * m), rel=1e-9)
