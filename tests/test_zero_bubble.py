"""The zero-bubble schedules (spec.schedules: ZB-H1, and ZBV's two chunks a stage in a V) run as
a whole pipeline: every stage's operations in its own order, each waiting for what it depends on
(the previous model chunk's forward, its own forward and the next chunk's B, its own B for a W),
sends never blocking (the runtime's isend). Every operation runs exactly once and no order
deadlocks, for p from 2 to 8 stages and any micro-batch count; the bubble is 1F1B's at most
under unlike chunk costs, and at equal costs exactly what the orders are built for. The stages'
peak memory, a micro-batch's activations held from its forward until its W, is 1F1B's peak at
most."""

from __future__ import annotations

import random

import pytest

from hethub.predictor import predict
from hethub.predictor.schedule import schedule_order, simulate
from hethub.predictor.sharing import CoreSharing, SharedLayout, simulate_shared
from hethub.predictor.weight_split import weight_gradient_share, weight_held_share
from hethub.spec import parse_cluster, parse_plan
from hethub.spec.model import load_model
from hethub.spec.ops import Kernels
from hethub.spec.plan import Plan, Precision, Recompute
from hethub.spec.schedules import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    Schedule,
    chunk_sequence,
    chunks_per_stage,
    in_flight_micro_batches,
    model_chunk,
    peak_in_flight,
)

ZERO_BUBBLE = (Schedule.ZB_H1, Schedule.ZBV)


def run_pipeline(schedule: Schedule, p: int, m: int, cost, chunks: int | None = None) -> float:
    """Simulate the whole pipeline, ``cost(kind, model chunk)`` each operation (1F1B's backward
    is its B and W together), ``chunks`` a stage where the schedule does not fix them
    (interleaved 1F1B); the time its last operation ends. Fails on a deadlock, an operation run
    twice or left out."""
    v = chunks_per_stage(schedule) or chunks or 1
    sequences = [chunk_sequence(schedule, s, p, v, m) for s in range(p)]
    done: dict[tuple[int, int, int], float] = {}  # (kind, model chunk, micro-batch) -> end
    position, free = [0] * p, [0.0] * p
    total = sum(len(sequence) for sequence in sequences)
    while len(done) < total:
        moved = False
        for s in range(p):
            while position[s] < len(sequences[s]):
                kind, chunk, j = sequences[s][position[s]]
                g = model_chunk(schedule, s, p, chunk)
                needs = []
                if kind == FORWARD and g > 0:
                    needs.append((FORWARD, g - 1, j))
                if kind == BACKWARD:
                    needs.append((FORWARD, g, j))
                    if g < p * v - 1:
                        needs.append((BACKWARD, g + 1, j))
                if kind == WEIGHT:
                    needs.append((BACKWARD, g, j))
                if any(n not in done for n in needs):
                    break
                start = max([free[s], *(done[n] for n in needs)])
                key = (kind, g, j)
                assert key not in done, f"{key} runs twice"
                done[key] = free[s] = start + cost(kind, g)
                position[s] += 1
                moved = True
        assert moved, f"deadlock: {schedule} p={p} m={m} at {position}"
    kinds = (FORWARD, BACKWARD, WEIGHT) if schedule.splits_backward else (FORWARD, BACKWARD)
    assert set(done) == {(k, g, j) for k in kinds for g in range(p * v) for j in range(m)}
    return max(done.values())


def counts(p: int) -> list[int]:
    return [*range(1, 3 * p + 2), 4 * p, 8 * p]


def chunk_costs(rng: random.Random, chunks: int) -> dict[tuple[int, int], float]:
    """Per model chunk, seeded: its work (layers and device: unlike stages, 4x apart), its B and
    W near its forward (the same layers on the same device; W 0.6-1.1 of F, B 0.9-1.3)."""
    costs = {}
    for g in range(chunks):
        work = rng.uniform(0.25, 1.0)
        costs[FORWARD, g] = work
        costs[BACKWARD, g] = work * rng.uniform(0.9, 1.3)
        costs[WEIGHT, g] = work * rng.uniform(0.6, 1.1)
    return costs


def one_f_one_b(costs: dict[tuple[int, int], float], schedule: Schedule, p: int):
    """The same work under 1F1B, a stage's chunks as one: its cost(kind, stage), B and W as one
    backward."""
    v = chunks_per_stage(schedule) or 1
    stage = {(FORWARD, s): 0.0 for s in range(p)} | {(BACKWARD, s): 0.0 for s in range(p)}
    for s in range(p):
        for c in range(v):
            g = model_chunk(schedule, s, p, c)
            stage[FORWARD, s] += costs[FORWARD, g]
            stage[BACKWARD, s] += costs[BACKWARD, g] + costs[WEIGHT, g]
    return lambda kind, s: stage[kind, s]


@pytest.mark.parametrize("schedule", ZERO_BUBBLE)
@pytest.mark.parametrize("p", range(2, 9))
def test_every_operation_runs_once_in_dependency_order_and_never_above_1f1b(schedule, p):
    rng = random.Random(p)
    v = chunks_per_stage(schedule)
    total = above = 0.0
    for m in counts(p):
        costs = chunk_costs(rng, p * v)
        end = run_pipeline(schedule, p, m, lambda kind, g, costs=costs: costs[kind, g])
        reference = run_pipeline(Schedule.ONE_F_ONE_B, p, m, one_f_one_b(costs, schedule, p))
        # ZBV's V is built for 2p - 1 micro-batches; below, cut short, it may lose a little
        if schedule == Schedule.ZB_H1 or m >= 2 * p - 1:
            assert end <= reference * (1 + 1e-12), (m, end, reference)
        total, above = total + reference, above + end
    assert above < total


def test_zb_h1_s_bubble_is_a_third_of_1f1b_s_at_equal_costs():
    # F = B = W = 1: 1F1B's bubble is (p - 1)(F + B + W), ZB-H1's (p - 1)(F + B - W) once
    # m >= p; below, the first micro-batch's F and B chains, 2p, and 2 a micro-batch more.
    for p in range(2, 9):
        for m in counts(p):
            reference = run_pipeline(Schedule.ONE_F_ONE_B, p, m, lambda kind, s: 1.0 + kind)
            assert reference == 3 * m + 3 * (p - 1)
            end = run_pipeline(Schedule.ZB_H1, p, m, lambda kind, s: 1.0)
            assert end == 3 * m + (p - 1) + max(0, p - m), (p, m)


def test_zbv_s_only_wait_at_equal_costs_is_each_stage_s_first_input():
    # Each chunk half a stage: F = B = W = 1/2. From 2p - 1 micro-batches on, the last stage
    # starts after the V's first p - 1 chunk forwards and then never waits: its 3m of work ends
    # the step, the least any order of these chunks can take. Below, no worse than ZB-H1.
    for p in range(2, 9):
        for m in counts(p):
            end = run_pipeline(Schedule.ZBV, p, m, lambda kind, g: 0.5)
            if m >= 2 * p - 1:
                assert end == 3 * m + (p - 1) / 2, (p, m)
            assert end <= run_pipeline(Schedule.ZB_H1, p, m, lambda kind, s: 1.0)


def test_peak_memory_held_until_w_is_1f1b_s_peak_at_most():
    for p in range(2, 9):
        for m in counts(p):
            first_stage = in_flight_micro_batches(Schedule.ONE_F_ONE_B, 0, p, m)
            for s in range(p):
                # ZB-H1: every stage holds its first stage's peak (later stages hold their W's)
                assert peak_in_flight(Schedule.ZB_H1, s, p, m, (3,)) == first_stage
                assert in_flight_micro_batches(Schedule.ZB_H1, s, p, m) == first_stage
                assert peak_in_flight(Schedule.ZBV, s, p, m, (2, 2)) <= first_stage
                assert in_flight_micro_batches(Schedule.ZBV, s, p, m) <= first_stage
                if m >= 2 * p:
                    # unequal chunks of a and b layers: 2p - s - 1 forwards of chunk 0 and s of
                    # chunk 1 held, and one more forward of either: past 1F1B's peak where the
                    # chunks differ, which the predictor prices from this walk
                    for a, b in ((3, 1), (1, 3)):
                        held = (2 * p - s - 1) * a + s * b + max(a, b)
                        assert peak_in_flight(Schedule.ZBV, s, p, m, (a, b)) == held / (a + b)


def test_the_walk_holds_a_chunk_until_its_w():
    # stage 1 of 2 under ZB-H1, 3 micro-batches: F0 B0 F1 B1 W0 F2 B2 W1 W2 holds two at once
    order = chunk_sequence(Schedule.ZB_H1, 1, 2, 1, 3)
    assert order == [
        (FORWARD, 0, 0),
        (BACKWARD, 0, 0),
        (FORWARD, 0, 1),
        (BACKWARD, 0, 1),
        (WEIGHT, 0, 0),
        (FORWARD, 0, 2),
        (BACKWARD, 0, 2),
        (WEIGHT, 0, 1),
        (WEIGHT, 0, 2),
    ]
    assert peak_in_flight(Schedule.ZB_H1, 1, 2, 3, (1,)) == 2
    assert peak_in_flight(Schedule.ONE_F_ONE_B, 1, 2, 3, (1,)) == 1


@pytest.mark.parametrize("schedule", ZERO_BUBBLE)
def test_the_predictor_s_simulation_is_the_whole_pipeline_s(schedule):
    rng = random.Random(7)
    p = 4
    v = chunks_per_stage(schedule)
    for m in (1, 3, 4, 9):
        costs = chunk_costs(rng, p * v)
        order = schedule_order(schedule, p, m, v)
        assert len(order.ops) == 3 * p * v * m
        per_kind = [[costs[kind, g] for g in range(p * v)] for kind in (FORWARD, BACKWARD, WEIGHT)]
        free = [0.0] * (p * v - 1)
        end = simulate(order, *per_kind[:2], free, free, weight_s=per_kind[2])
        expected = run_pipeline(schedule, p, m, lambda kind, g, costs=costs: costs[kind, g])
        assert max(end[i] for i in order.last_op) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("name", ["llama-70b", "gpt-1.3b", "local-llama"])
def test_w_reads_what_the_forward_keeps_and_takes_under_half_the_backward(name):
    model = load_model(name)
    for tp in (1, 4):
        # W's inputs (the linears' inputs and outputs' gradients) weigh what the forward keeps:
        # why spec.schedules holds a micro-batch's activations whole until its W
        held = weight_held_share(model, tp, 1, Precision.BF16, Kernels.FUSED)
        assert 0.99 < held <= 1.0
        share = weight_gradient_share(model, tp, 1, Precision.BF16, Kernels.FUSED)
        assert 0.4 < share < 0.5  # attention's backward has no weight
        # a recomputed forward runs on B's side: W's FLOPs are the same, the backward's more
        full = weight_gradient_share(model, tp, 1, Precision.BF16, Kernels.FUSED, Recompute.FULL)
        assert full < share


def _plan(schedule: str, split: list) -> Plan:
    return parse_plan(
        {
            "model": "llama-7b",
            "global_batch": 16,
            "micro_batch": 1,
            "schedule": schedule,
            "pipelines": [
                {
                    "count": 1,
                    "micro_batches": 16,
                    **({"virtual_stages": 2} if schedule == "zbv" else {}),
                    "stages": [
                        {"group": group, "tp": 2, "layers": layers}
                        for group, layers in zip(("fast", "fast", "slow", "slow"), split)
                    ],
                }
            ],
        }
    )


def test_predict_prices_w_in_the_bubbles_and_the_memory_it_holds():
    accelerator = {
        "vendor": "other",
        "memory_gb": 80,
        "memory_bw_gb_s": 2000,
        "intra_node_gb_s": 300,
        "host_link_gb_s": 32,
        "network_gbps": 800,
    }
    groups = [
        {
            "name": n,
            "accelerator": {**accelerator, "name": n, "bf16_tflops": t},
            "nodes": 1,
            "devices_per_node": 4,
        }
        for n, t in (("fast", 400), ("slow", 300))
    ]
    cluster = parse_cluster({"groups": groups, "cross_group_gbps": 400}, "test")
    model = load_model("llama-7b")
    plans = {
        "1f1b": _plan("1f1b", [7, 7, 9, 9]),
        "zb-h1": _plan("zb-h1", [7, 7, 9, 9]),
        "zbv": _plan("zbv", [[4, 3], [4, 3], [5, 4], [5, 4]]),
    }
    results = {name: predict(plan, cluster, model, timeline=True) for name, plan in plans.items()}
    bubbles = {name: r.bubble_fraction for name, r in results.items()}
    assert bubbles["zbv"] < bubbles["zb-h1"] < bubbles["1f1b"]
    # the same work: each stage's forward and whole backward, W included
    for one, zb in zip(results["1f1b"].stages, results["zb-h1"].stages):
        assert zb.compute_s == pytest.approx(one.compute_s, rel=1e-12)
    for name, chunks in (("zb-h1", 1), ("zbv", 2)):
        weights = [e for e in results[name].timeline if e.kind == "weight"]
        assert len(weights) == 4 * chunks * 16
    # ZB-H1's last stage holds its W's inputs: the first stage's micro-batches in flight
    last = [r.stages[-1].memory.activations_gb for r in (results["1f1b"], results["zb-h1"])]
    assert last[1] == pytest.approx(4 * last[0], rel=1e-12)
    # ZBV's first stage holds the head, its last stage none
    assert results["zbv"].stages[0].memory.buffers_gb > results["zbv"].stages[-1].memory.buffers_gb


@pytest.mark.parametrize("schedule", ZERO_BUBBLE)
def test_ranks_sharing_cores_run_w_too(schedule):
    # with no slowdown from sharing (alone = 1), the fluid simulation is the max-plus one
    rng = random.Random(3)
    p, m = 3, 5
    v = chunks_per_stage(schedule)
    costs = chunk_costs(rng, p * v)
    per_kind = [[costs[kind, g] for g in range(p * v)] for kind in (FORWARD, BACKWARD, WEIGHT)]
    sends = [0.01] * (p * v - 1)
    order = schedule_order(schedule, p, m, v)
    layout = SharedLayout(
        order=order,
        forward_s=per_kind[0],
        backward_s=per_kind[1],
        weight_s=per_kind[2],
        send_forward_s=sends,
        send_backward_s=sends,
        ranks=[1] * p,
        speed=[1.0] * p,
    )
    ((_, shared),) = simulate_shared([layout], CoreSharing(cores=2, ranks=p, least=1, alone=1.0))
    alone = simulate(order, *per_kind[:2], sends, sends, weight_s=per_kind[2], every_op=True)
    assert shared == pytest.approx(alone, rel=1e-9)
