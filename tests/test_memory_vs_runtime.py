"""The predictor's stage memory is what the runtime's ranks really hold (issue 26: within 5%):
real gloo ranks run a step of tiny-llama, profiler.live_bytes counts every tensor they hold at
the step's peak (benchmarks/memory_vs_runtime.py's measure), against `hethub predict`'s stage
memory of the same plan. The plans cover bf16 and fp32, TP 1 and 2, recomputation on and off,
first, middle and last stages."""

from __future__ import annotations

import pytest
from benchmark_scripts import load_benchmark

from hethub.predictor import predict
from hethub.runtime.spawn import run_ranks
from hethub.spec import load_model, parse_cluster, parse_plan
from hethub.spec.schedules import in_flight_micro_batches

MODEL = "tiny-llama"
TOLERANCE = 0.05  # issue 26
REST_TOLERANCE = 0.015
"""The rest, with the layers' activations priced at a layer's measured saved bytes: what the
stage holds besides them (state, boundary tensors, loss, backward peaks) is priced closer."""


def _measure(rank: int, world: int, fields: dict):
    return load_benchmark("memory_vs_runtime").measure_rank(rank, world, MODEL, fields)


@pytest.mark.parametrize(
    ("precision", "recompute", "tp", "stages", "micro_batches"),
    [
        ("fp32", "none", 1, 3, 2),
        ("bf16", "full", 1, 3, 2),
        ("bf16", "none", 2, 2, 2),
    ],
)
def test_stage_memory_is_what_the_ranks_hold(precision, recompute, tp, stages, micro_batches):
    bench = load_benchmark("memory_vs_runtime")
    model = load_model(MODEL)
    fields = bench.plan_fields(
        precision, recompute, tp, stages, model.layers, micro_batches=micro_batches
    )
    plan = parse_plan({"model": MODEL, **fields})
    held = run_ranks(_measure, tp * stages, fields, timeout_s=120, purpose="memory test")
    prediction = predict(plan, parse_cluster(bench.CLUSTER, "test"), model)
    for stage in prediction.stages:
        in_flight = in_flight_micro_batches(plan.schedule, stage.position, stages, micro_batches)
        for rank in range(stage.position * tp, (stage.position + 1) * tp):
            measured = held[rank].peak
            where = f"stage {stage.position}, rank {rank}"
            assert stage.memory.total_gb * 1e9 == pytest.approx(measured, rel=TOLERANCE), where
            rest = bench.rest_prediction(plan, model, stage, held[rank], in_flight)
            assert rest == pytest.approx(measured, rel=REST_TOLERANCE), where


def _first_stage_peak(rank: int, world: int, fields: dict) -> int:
    return _measure(rank, world, fields).peak


def test_a_first_stage_holds_no_more_with_more_micro_batches():
    """1F1B keeps as many micro-batches in flight on the first of two stages however many the
    step runs: an activation's send is finished when its gradient comes back, not held to the
    step's end with every other (held so, 12 micro-batches took 3.3% more than 2 here)."""
    bench = load_benchmark("memory_vs_runtime")
    layers = load_model(MODEL).layers
    peaks = [
        run_ranks(
            _first_stage_peak,
            2,
            bench.plan_fields("fp32", "none", 1, 2, layers, micro_batches=micro_batches),
            timeout_s=120,
            purpose="memory test",
        )[0]
        for micro_batches in (2, 12)
    ]
    assert peaks[1] == pytest.approx(peaks[0], rel=0.005)
