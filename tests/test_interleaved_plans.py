"""Interleaved 1F1B, the sharded optimizer and the overlapped gradient sync in the plan format
and the predictor: the plan's rules, and what each option does to a prediction."""

from __future__ import annotations

import dataclasses

import pytest

from hethub.errors import SpecError
from hethub.predictor import predict
from hethub.predictor.memory import stage_memory_at
from hethub.predictor.stage import MIDDLE, StagePosition, StageShape
from hethub.spec import load_model, parse_cluster
from hethub.spec.parameters import parameter_counts
from hethub.spec.plan import Precision, UniformLayout, parse_plan, uniform_plan
from hethub.spec.schedules import (
    FORWARD,
    chunk_sequence,
    in_flight_micro_batches,
    peak_in_flight,
)

CLUSTER = parse_cluster(
    {"groups": [{"name": "nv", "accelerator": "a100-80gb", "nodes": 8, "devices_per_node": 8}]}
)
MODEL = load_model("llama-7b")


def plan_data(**changes) -> dict:
    data = {
        "model": "llama-7b",
        "global_batch": 16,
        "schedule": "interleaved-1f1b",
        "pipelines": [
            {
                "count": 2,
                "virtual_stages": 2,
                "stages": [
                    {"group": "nv", "tp": 8, "layers": [10, 6]},
                    {"group": "nv", "tp": 8, "layers": [7, 9]},
                ],
            }
        ],
    }
    data.update(changes)
    return data


def test_an_interleaved_plan_parses_round_trips_and_orders_its_chunks() -> None:
    plan = parse_plan(plan_data(), "plan.yaml")
    layout = plan.pipelines[0]
    assert layout.virtual_stages == 2
    assert [s.layers for s in layout.stages] == [16, 16]
    # stage s of p holds the model's chunks s, s + p: model order 10, 7, 6, 9
    assert layout.chunk_layers() == [10, 7, 6, 9]
    assert parse_plan(plan.to_dict(), "again") == plan


@pytest.mark.parametrize(
    ("change", "field", "rule"),
    [
        ({"layers": [10, 6, 1]}, "stages[0].layers", "list of virtual_stages (2)"),
        ({"layers": 16}, "stages[0].layers", "list of virtual_stages (2)"),
        ({"layers": [10, 0]}, "stages[0].layers", "positive integers"),
    ],
)
def test_a_chunk_list_that_breaks_a_rule_is_refused_in_one_line(change, field, rule) -> None:
    data = plan_data()
    data["pipelines"][0]["stages"][0].update(change)
    with pytest.raises(SpecError) as info:
        parse_plan(data, "plan.yaml")
    assert field in str(info.value) and rule in str(info.value)
    assert "\n" not in str(info.value)


def test_virtual_stages_need_the_interleaved_schedule_and_two_stages() -> None:
    with pytest.raises(SpecError, match="needs schedule interleaved-1f1b"):
        parse_plan(plan_data(schedule="1f1b"), "plan.yaml")
    data = plan_data()
    data["pipelines"][0]["stages"] = [{"group": "nv", "tp": 8, "layers": [16, 16]}]
    with pytest.raises(SpecError, match="at least 2 stages"):
        parse_plan(data, "plan.yaml")


def test_chunks_must_sum_to_the_model_layers() -> None:
    from hethub.spec import check_plan

    data = plan_data()
    data["pipelines"][0]["stages"][1]["layers"] = [7, 8]
    with pytest.raises(SpecError, match="must sum to the model's 32 layers"):
        check_plan(parse_plan(data, "plan.yaml"), CLUSTER, MODEL, "plan.yaml")


def test_flags_must_be_booleans() -> None:
    with pytest.raises(SpecError, match="shard_optimizer = 'yes': must be true or false"):
        parse_plan(plan_data(shard_optimizer="yes"), "plan.yaml")


def test_replicas_may_differ_in_virtual_stages() -> None:
    plain = {"count": 1, "stages": [{"group": "nv", "tp": 8, "layers": 16}] * 2}
    data = plan_data(global_batch=24)
    data["pipelines"].append(plain)
    plan = parse_plan(data, "plan.yaml")
    assert [p.virtual_stages for p in plan.pipelines] == [2, 1]
    prediction = predict(plan, CLUSTER, MODEL)
    # Each layout runs its own schedule on its 8 micro-batches a replica, as it would alone...
    interleaved_alone = predict(parse_plan(plan_data(), "alone"), CLUSTER, MODEL)
    plain_alone = predict(parse_plan(plan_data(global_batch=8, pipelines=[plain])), CLUSTER, MODEL)
    alone = interleaved_alone.pipeline_time_s + plain_alone.pipeline_time_s
    assert prediction.pipeline_time_s == pytest.approx(alone, rel=1e-12)
    # ... the interleaved one with the smaller bubble (the same stages, half-size chunks)
    assert prediction.pipeline_time_s[0] < prediction.pipeline_time_s[1]
    # and the step waits for the slower layout before the gradient sync across both
    assert prediction.iteration_time_s > max(prediction.pipeline_time_s)


def uniform_of(**fields):
    """spec.plan.uniform_plan from its layout's fields and the plan's, given together."""
    names = {f.name for f in dataclasses.fields(UniformLayout)}
    layout = UniformLayout(**{k: v for k, v in fields.items() if k in names})
    return uniform_plan(layout, **{k: v for k, v in fields.items() if k not in names})


def uniform(v: int = 1, **options):
    return uniform_of(
        model="llama-7b",
        group="nv",
        tp=8,
        pp=4,
        dp=1,
        micro_batch=1,
        global_batch=16,
        layers=32,
        virtual_stages=v,
        schedule="interleaved-1f1b",
        **options,
    )


def test_one_chunk_per_stage_predicts_exactly_as_plain_1f1b() -> None:
    plain = predict(uniform_of(**{**_uniform_args(), "schedule": "1f1b"}), CLUSTER, MODEL)
    interleaved = predict(uniform(1), CLUSTER, MODEL)
    assert interleaved.iteration_time_s == plain.iteration_time_s
    assert interleaved.peak_memory_gb == plain.peak_memory_gb


def _uniform_args() -> dict:
    return {
        "model": "llama-7b",
        "group": "nv",
        "tp": 8,
        "pp": 4,
        "dp": 1,
        "micro_batch": 1,
        "global_batch": 16,
        "layers": 32,
    }


def test_interleaving_shrinks_the_bubble_and_costs_activation_memory() -> None:
    one, two, four = (predict(uniform(v), CLUSTER, MODEL) for v in (1, 2, 4))
    assert four.bubble_fraction < two.bubble_fraction < 0.75 * one.bubble_fraction
    assert four.iteration_time_s < two.iteration_time_s < one.iteration_time_s
    # Megatron's warm-up holds more chunks in flight than 1F1B's p - s micro-batches of the stage
    assert two.stages[0].memory.activations_gb > one.stages[0].memory.activations_gb


def test_in_flight_memory_is_read_from_the_order() -> None:
    p, v, m = 4, 2, 8
    for s in range(p):
        held = peak = 0
        for kind, _, _ in chunk_sequence("interleaved-1f1b", s, p, v, m):
            held += 1 if kind == FORWARD else -1
            peak = max(peak, held)
        # equal chunks: the peak count of chunk-micro-batches, in whole stages
        assert in_flight_micro_batches("interleaved-1f1b", s, p, m, (3, 3)) == peak / v
    # unequal chunks weigh their layers: at stage 0's peak more of chunk 0's micro-batches are
    # in flight than of chunk 1's, so which chunk is the larger changes the peak
    assert in_flight_micro_batches("interleaved-1f1b", 0, p, m, (1, 5)) != (
        in_flight_micro_batches("interleaved-1f1b", 0, p, m, (5, 1))
    )
    assert in_flight_micro_batches("1f1b", 1, p, m) == p - 1
    assert in_flight_micro_batches("gpipe", 3, p, m) == m


def test_a_sharded_optimizer_keeps_six_plus_twelve_over_d_bytes_per_parameter() -> None:
    position = StagePosition.of(1, 3)
    whole = stage_memory_at(StageShape(MODEL, 4, 1, position, 1, "none", Precision.BF16), 1)
    for d in (2, 4, 8):
        sharded = stage_memory_at(
            StageShape(MODEL, 4, 1, position, 1, "none", Precision.BF16), 1, d
        )
        params = 4 * parameter_counts(MODEL).layer
        assert sharded.weights_gb + sharded.grads_gb == pytest.approx(6 * params / 1e9)
        assert sharded.optimizer_gb == pytest.approx(12 * params / d / 1e9)
        assert sharded.optimizer_gb == pytest.approx(whole.optimizer_gb / d)


def test_sharding_over_replicas_shrinks_the_state_and_the_optimizer_step() -> None:
    args = {**_uniform_args(), "dp": 4, "pp": 1, "global_batch": 8}
    plain = predict(uniform_of(**args), CLUSTER, MODEL)
    sharded = predict(uniform_of(**args, shard_optimizer=True), CLUSTER, MODEL)
    assert sharded.stages[0].memory.optimizer_gb == pytest.approx(
        plain.stages[0].memory.optimizer_gb / 4
    )
    assert sharded.stages[0].optimizer_s == pytest.approx(plain.stages[0].optimizer_s / 4)
    # a reduce-scatter of fp32 gradients and an all-gather of bf16 weights: 3/4 of the traffic
    assert sharded.stages[0].grad_sync_s == pytest.approx(0.75 * plain.stages[0].grad_sync_s)
    assert sharded.to_json()["shard_optimizer"] is True


@pytest.mark.parametrize("v", [1, 2])
def test_an_overlapped_sync_hides_behind_the_backwards_but_never_ends_before_them(v) -> None:
    args = {**_uniform_args(), "dp": 4, "pp": 2, "global_batch": 16}
    plain = predict(
        uniform_of(**args, virtual_stages=v, schedule="interleaved-1f1b"), CLUSTER, MODEL
    )
    overlapped = predict(
        uniform_of(**args, virtual_stages=v, schedule="interleaved-1f1b", overlap_grad_sync=True),
        CLUSTER,
        MODEL,
    )
    assert overlapped.iteration_time_s < plain.iteration_time_s
    compute_end = max(s.end_s for s in overlapped.stages)
    optimizer = max(s.optimizer_s for s in overlapped.stages)
    assert overlapped.iteration_time_s > compute_end + optimizer


def test_one_chunk_in_flight_closed_form_matches_the_walk() -> None:
    for schedule in ("1f1b", "gpipe", "interleaved-1f1b"):
        for p in range(1, 9):
            for m in range(1, 3 * p + 1):
                for s in range(p):
                    assert in_flight_micro_batches(schedule, s, p, m) == peak_in_flight(
                        schedule, s, p, m, (1,)
                    ), (schedule, s, p, m)


def test_sharded_optimizer_state_is_twelve_bytes_over_d_in_bf16_and_eight_in_fp32() -> None:
    # The runtime's ShardedAdamW keeps the two moments of its shard and, in bf16, an fp32 master
    # copy of it (12/d); in fp32 it steps the shard of the weights themselves (8/d).
    model = load_model("tiny-llama")
    for precision, state in ((Precision.BF16, 12), (Precision.FP32, 8)):
        alone = stage_memory_at(StageShape(model, 2, 1, MIDDLE, 1, "none", precision), 1, 1)
        shared = stage_memory_at(StageShape(model, 2, 1, MIDDLE, 1, "none", precision), 1, 4)
        params = alone.weights_gb / (2 if precision == "bf16" else 4)
        assert shared.optimizer_gb == pytest.approx(params * state / 4)
        assert shared.weights_gb == alone.weights_gb and shared.grads_gb == alone.grads_gb


def test_a_uniform_plan_is_the_plan_its_file_says() -> None:
    built = uniform(2, shard_optimizer=True)
    written = parse_plan(built.to_dict(), "round trip")
    assert built == written
    assert [s.chunks for s in built.pipelines[0].stages] == [(4, 4)] * 4  # 32 layers, 8 chunks
    with pytest.raises(SpecError, match="multiple of dp x micro_batch"):
        uniform_of(**{**_uniform_args(), "dp": 3})
