"""Recomputation chosen per stage (issue 28, item 6): ``none``, ``selective`` (each layer's
attention's inner part rebuilt in the backward) or ``full`` (each layer rebuilt), each stage its
own. Every such layout against the single-process reference (tests/test_engine.py's check: fp32
first-step gradients with assert_close and the losses within 1e-5; bf16 within its rounding,
gradients compared), and the predictor's memory of a per-stage plan against what the runtime's
ranks hold (tests/test_memory_vs_runtime.py's measure)."""

from __future__ import annotations

import pytest
import torch
from benchmark_scripts import load_benchmark
from test_engine import CLUSTER, PLANS, check_against_reference, stage
from test_layer_ops import SavedBytes, Trace
from test_memory_vs_runtime import REST_TOLERANCE, TOLERANCE
from test_pricing import CAL, GROUP, SHAPE, _layer, _profiles

from hethub.cli.summary import describe
from hethub.predictor import predict
from hethub.predictor.compute import layer_cost, selective_rerun_share
from hethub.predictor.pricing import pricing_for
from hethub.runtime.model import Stage
from hethub.runtime.spawn import run_ranks
from hethub.spec import load_model, parse_cluster, parse_plan
from hethub.spec.buckets import BUCKET_BYTES
from hethub.spec.layer_ops import layer_ops
from hethub.spec.ops import Kernels
from hethub.spec.plan import Precision, Recompute
from hethub.spec.schedules import in_flight_micro_batches


def recomputing(group: str, tp: int, layers, recompute: str) -> dict:
    return {**stage(group, tp, layers), "recompute": recompute}


STAGE_RECOMPUTE_PLANS = {
    "full on one stage, none on the other": (
        "tiny-llama",
        {
            "global_batch": 4,
            "pipelines": [
                {
                    "count": 1,
                    "micro_batches": 4,
                    "stages": [recomputing("nv", 1, 5, "full"), stage("nv", 1, 3)],
                }
            ],
        },
    ),
    "selective at tp 2 across vendors": (
        "tiny-llama",
        {
            "global_batch": 4,
            "recompute": "full",
            "pipelines": [
                {
                    "count": 1,
                    "micro_batches": 4,
                    "stages": [recomputing("nv", 2, 3, "selective"), stage("amd", 2, 5)],
                }
            ],
        },
    ),
    "selective gpt at tp 2, none": (
        "tiny-gpt",
        {
            "global_batch": 2,
            "pipelines": [
                {
                    "count": 1,
                    "micro_batches": 2,
                    "stages": [recomputing("nv", 2, 4, "selective"), stage("amd", 1, 4)],
                }
            ],
        },
    ),
    "interleaved, each stage its own": (
        "tiny-llama",
        {
            "global_batch": 4,
            "schedule": "interleaved-1f1b",
            "pipelines": [
                {
                    "count": 1,
                    "micro_batches": 4,
                    "virtual_stages": 2,
                    "stages": [
                        recomputing("nv", 1, [1, 3], "selective"),
                        recomputing("amd", 1, [2, 2], "full"),
                    ],
                }
            ],
        },
    ),
}


def test_the_plans_give_each_stage_its_own_recomputation():
    recomputes = {
        name: [s.recompute for s in parse_plan({"model": preset, **fields}).pipelines[0].stages]
        for name, (preset, fields) in STAGE_RECOMPUTE_PLANS.items()
    }
    assert recomputes == {
        "full on one stage, none on the other": [Recompute.FULL, Recompute.NONE],
        "selective at tp 2 across vendors": [Recompute.SELECTIVE, Recompute.FULL],
        "selective gpt at tp 2, none": [Recompute.SELECTIVE, Recompute.NONE],
        "interleaved, each stage its own": [Recompute.SELECTIVE, Recompute.FULL],
    }


def test_hethub_predict_shows_each_stage_s_recomputation():
    preset, fields = STAGE_RECOMPUTE_PLANS["selective at tp 2 across vendors"]
    plan, model = parse_plan({"model": preset, **fields}), load_model(preset)
    text = describe(predict(plan, CLUSTER, model), plan, CLUSTER, model, "plan.yaml", "analytic")
    header, _, *rows = text.splitlines()[2:6]
    assert "recompute per stage" in text and "recompute" in header.split()
    column = header.split().index("recompute")
    assert [row.split()[column + 1] for row in rows] == ["selective", "full"]  # "0 (x1)": 2 cells


def test_a_selective_stage_keeps_less_and_runs_each_layer_s_inner_attention_again():
    """A stage of two layers under each recomputation: what its forward keeps, and how many
    attention kernels its backward runs forward again (selective: one a layer), as
    spec.layer_ops says of one layer."""
    model, layers, micro_batch = load_model("tiny-llama"), 2, 2
    stage = Stage.build(model, 0, layers, None, is_first=False, is_last=False, seed=0)
    x = torch.randn(micro_batch, model.seq_len, model.hidden, requires_grad=True)
    kept, reruns = {}, {}
    for recompute in Recompute:
        saved = SavedBytes([*stage.parameters(), *stage.buffers()])
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda tensor: tensor):
            y = stage(x, recompute=recompute)
        with Trace() as backward:
            y.backward(torch.ones_like(y))
        kept[recompute] = saved.total
        reruns[recompute] = sum(op.name.endswith("attention_for_cpu") for op in backward.ops)
    assert reruns == {Recompute.NONE: 0, Recompute.SELECTIVE: layers, Recompute.FULL: layers}
    one_layer = {
        r: layer_ops(model, 1, micro_batch, Precision.FP32, Kernels.CPU, r).saved_bytes
        for r in Recompute
    }
    saving = one_layer[Recompute.NONE] - one_layer[Recompute.SELECTIVE]
    assert kept[Recompute.NONE] - kept[Recompute.SELECTIVE] == layers * saving
    assert kept[Recompute.NONE] == layers * one_layer[Recompute.NONE]
    assert kept[Recompute.FULL] == layers * x.nbytes  # each layer's input


def test_selective_recomputation_is_priced_as_the_rerun_attention_analytically_and_profiled():
    """Analytic: a layer's backward grows by the inner attention's forward (its ops priced),
    its forward is unchanged. Profiled: by the measured forward times the analytic share."""
    shapes = {r: SHAPE._replace(recompute=r) for r in Recompute}
    analytic = {r: pricing_for(CAL, None).work(GROUP, shape) for r, shape in shapes.items()}
    assert analytic[Recompute.SELECTIVE].forward_s == analytic[Recompute.NONE].forward_s
    added = analytic[Recompute.SELECTIVE].backward_s - analytic[Recompute.NONE].backward_s
    costs = {
        r: layer_cost(SHAPE.layer._replace(recompute=r), GROUP.accelerator, CAL, 0.0)
        for r in Recompute
    }
    share = selective_rerun_share(SHAPE.layer, GROUP.accelerator, CAL, 0.0)
    assert added == pytest.approx(SHAPE.layers * share * costs[Recompute.NONE].forward_s)
    # The inner attention is some of the forward, not all of it (full recomputation's rerun).
    full_share = (costs[Recompute.FULL].backward_s - costs[Recompute.NONE].backward_s) / (
        costs[Recompute.NONE].forward_s
    )
    assert 0 < share < full_share == pytest.approx(1.0)
    profile = _layer()
    profiled = pricing_for(CAL, _profiles(profile))
    measured = {r: profiled.work(GROUP, shape) for r, shape in shapes.items()}
    rerun = measured[Recompute.SELECTIVE].backward_s - measured[Recompute.NONE].backward_s
    assert rerun == pytest.approx(SHAPE.layers * share * profile.layer_forward_s)


@pytest.mark.slow
@pytest.mark.parametrize("name", STAGE_RECOMPUTE_PLANS)
def test_per_stage_recomputation_matches_the_single_process_reference(name, monkeypatch):
    monkeypatch.setitem(PLANS, name, STAGE_RECOMPUTE_PLANS[name])
    check_against_reference(name, BUCKET_BYTES)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["selective at tp 2 across vendors", "interleaved, each stage its own"]
)
def test_per_stage_recomputation_in_bf16_matches_the_bf16_reference(name, monkeypatch):
    monkeypatch.setitem(PLANS, name, STAGE_RECOMPUTE_PLANS[name])
    check_against_reference(name, BUCKET_BYTES, "bf16")


MEMORY_MODEL = "tiny-llama"


def _measure(rank: int, world: int, fields: dict):
    return load_benchmark("memory_vs_runtime").measure_rank(rank, world, MEMORY_MODEL, fields)


@pytest.mark.slow
def test_a_per_stage_plan_s_memory_is_what_its_ranks_hold():
    """Three stages, full, selective and none: each stage's predicted peak against its rank's
    counted peak, at tests/test_memory_vs_runtime.py's tolerances."""
    bench = load_benchmark("memory_vs_runtime")
    model = load_model(MEMORY_MODEL)
    fields = bench.plan_fields("bf16", "none", 1, 3, model.layers, micro_batches=2)
    for raw, recompute in zip(fields["pipelines"][0]["stages"], ("full", "selective", "none")):
        raw["recompute"] = recompute
    plan = parse_plan({"model": MEMORY_MODEL, **fields})
    held = run_ranks(_measure, 3, fields, timeout_s=120, purpose="memory test")
    prediction = predict(plan, parse_cluster(bench.CLUSTER, "test"), model)
    for stage_prediction in prediction.stages:
        s = stage_prediction.position
        in_flight = in_flight_micro_batches(plan.schedule, s, 3, 2)
        where = f"stage {s}, {plan.pipelines[0].stages[s].recompute}"
        measured = held[s].peak
        predicted = stage_prediction.memory.total_gb * 1e9
        assert predicted == pytest.approx(measured, rel=TOLERANCE), where
        rest = bench.rest_prediction(plan, model, stage_prediction, held[s], in_flight)
        assert rest == pytest.approx(measured, rel=REST_TOLERANCE), where
