"""predict() as a whole: accounting, heterogeneous plans, monotonic properties, the trace."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hethub.cli import main
from hethub.predictor import default_calibration, predict
from hethub.report.timeline import TimelineEvent
from hethub.report.trace import chrome_trace
from hethub.spec import check_plan, load_model, parse_cluster, parse_plan
from hethub.spec.parameters import parameter_count

MODEL = load_model("llama-7b")


def cluster_of(**overrides):
    accelerator = {
        "name": "x",
        "vendor": "other",
        "bf16_tflops": 300,
        "memory_gb": 80,
        "memory_bw_gb_s": 2000,
        "intra_node_gb_s": 300,
        "host_link_gb_s": 32,
        "network_gbps": 800,
    }
    accelerator.update(overrides)
    return parse_cluster(
        {"groups": [{"name": "g", "accelerator": accelerator, "nodes": 4, "devices_per_node": 8}]},
        "test",
    )


def plan_of(tp=2, split=(16, 16), dp=2, micro_batches=8, micro_batch=1, recompute="none"):
    return parse_plan(
        {
            "model": "llama-7b",
            "global_batch": dp * micro_batches * micro_batch,
            "micro_batch": micro_batch,
            "recompute": recompute,
            "pipelines": [
                {"count": dp, "stages": [{"group": "g", "tp": tp, "layers": n} for n in split]}
            ],
        }
    )


def test_single_stage_step_is_micro_batches_times_work_plus_sync_optimizer_and_overhead():
    cluster, plan = cluster_of(), plan_of(split=(32,), micro_batches=4)
    result = predict(plan, cluster, MODEL)
    (stage,) = result.stages
    expected = 4 * (stage.forward_s + stage.backward_s) + stage.grad_sync_s + stage.optimizer_s
    expected += default_calibration().step_overhead_ms * 1e-3
    assert result.iteration_time_s == pytest.approx(expected, rel=1e-12)
    assert result.tokens_per_s == pytest.approx(8 * 4096 / result.iteration_time_s, rel=1e-12)
    assert result.bubble_fraction == pytest.approx(0.0, abs=1e-12)


def test_model_tflops_count_six_flops_per_parameter_and_token_plus_attention():
    result = predict(plan_of(), cluster_of(), MODEL)
    tokens = 16 * 4096
    # Six a token for each weight of a matrix product: not the embedding's (a lookup) nor the
    # RMSNorms' (two a layer and the final one), which do no matrix product.
    norms = (2 * MODEL.layers + 1) * MODEL.hidden
    dense = 6 * (parameter_count(MODEL) - MODEL.vocab * MODEL.hidden - norms) * tokens
    attention = 3 * MODEL.layers * 4 * 4096 * MODEL.hidden * tokens
    assert (
        result.model_tflops_per_device * result.iteration_time_s * result.devices * 1e12
        == pytest.approx(dense + attention, rel=1e-12)
    )


def test_recomputation_costs_time_and_saves_memory():
    plain = predict(plan_of(), cluster_of(), MODEL)
    recomputed = predict(plan_of(recompute="full"), cluster_of(), MODEL)
    assert recomputed.iteration_time_s > plain.iteration_time_s
    assert recomputed.peak_memory_gb < plain.peak_memory_gb


def test_a_plan_that_does_not_fit_is_still_predicted():
    plan = plan_of(tp=1, split=(32,), dp=1)
    result = predict(plan, cluster_of(memory_gb=24), MODEL)
    assert not result.fits and result.peak_memory_gb > 24
    # priced all the same: the device's memory changes whether it fits, not the time
    roomy = predict(plan, cluster_of(memory_gb=24 * 100), MODEL)
    assert roomy.fits and result.iteration_time_s == roomy.iteration_time_s
    assert result.peak_memory_gb == roomy.peak_memory_gb


HETERO = parse_cluster(
    {
        "groups": [
            {"name": "nv", "accelerator": "a100-80gb", "nodes": 1, "devices_per_node": 8},
            {"name": "nv2", "accelerator": "h100", "nodes": 1, "devices_per_node": 8},
            {"name": "amd", "accelerator": "mi250x", "nodes": 1, "devices_per_node": 8},
        ]
    },
    "hetero",
)


def test_stage_boundary_across_vendors_is_slower_than_within_a_vendor():
    def boundary(second):
        plan = parse_plan(
            {
                "model": "llama-7b",
                "global_batch": 8,
                "pipelines": [
                    {
                        "stages": [
                            {"group": "nv", "tp": 4, "layers": 16},
                            {"group": second, "tp": 4, "layers": 16},
                        ]
                    }
                ],
            }
        )
        check_plan(plan, HETERO, MODEL)
        return predict(plan, HETERO, MODEL).stages[0].send_s

    assert boundary("amd") > boundary("nv2") > boundary("nv")


def test_unlike_replicas_run_side_by_side_and_sync_over_the_bridge():
    plan = parse_plan(
        {
            "model": "llama-7b",
            "global_batch": 24,
            "pipelines": [
                {
                    "count": 1,
                    "micro_batches": 16,
                    "stages": [{"group": "nv2", "tp": 8, "layers": 32}],
                },
                {
                    "count": 1,
                    "micro_batches": 8,
                    "stages": [
                        {"group": "amd", "tp": 4, "layers": 20},
                        {"group": "amd", "tp": 4, "layers": 12},
                    ],
                },
            ],
        }
    )
    check_plan(plan, HETERO, MODEL)
    result = predict(plan, HETERO, MODEL)
    assert len(result.pipeline_time_s) == 2 and result.devices == 16
    slowest = max(result.pipeline_time_s)
    assert result.iteration_time_s >= slowest + min(s.grad_sync_s for s in result.stages)
    same_vendor = predict(
        parse_plan(
            {
                "model": "llama-7b",
                "global_batch": 24,
                "pipelines": [
                    {
                        "count": 1,
                        "micro_batches": 16,
                        "stages": [{"group": "nv2", "tp": 8, "layers": 32}],
                    },
                    {
                        "count": 1,
                        "micro_batches": 8,
                        "stages": [
                            {"group": "nv", "tp": 4, "layers": 20},
                            {"group": "nv", "tp": 4, "layers": 12},
                        ],
                    },
                ],
            }
        ),
        HETERO,
        MODEL,
    )
    assert result.stages[0].grad_sync_s > same_vendor.stages[0].grad_sync_s


faster = st.floats(min_value=1.0, max_value=8.0)


@settings(max_examples=60, deadline=None)
@given(
    tp=st.sampled_from([1, 2, 4, 8]),
    stages=st.sampled_from([1, 2, 4]),
    mb=st.sampled_from([1, 2]),
    recompute=st.sampled_from(["none", "full"]),
    flops=faster,
    bandwidth=faster,
    link=faster,
    network=faster,
)
def test_a_faster_accelerator_or_link_never_predicts_slower(
    tp, stages, mb, recompute, flops, bandwidth, link, network
):
    plan = plan_of(
        tp=tp,
        split=[32 // stages] * stages,
        dp=1,
        micro_batches=8,
        micro_batch=mb,
        recompute=recompute,
    )
    base = predict(plan, cluster_of(), MODEL).iteration_time_s
    quicker = cluster_of(
        bf16_tflops=300 * flops,
        memory_bw_gb_s=2000 * bandwidth,
        intra_node_gb_s=300 * link,
        network_gbps=800 * network,
    )
    assert predict(plan, quicker, MODEL).iteration_time_s <= base * (1 + 1e-12)


@settings(max_examples=60, deadline=None)
@given(
    split=st.lists(st.integers(1, 12), min_size=2, max_size=6),
    tp=st.sampled_from([1, 2, 4]),
    m=st.integers(1, 24),
    extra=st.integers(1, 24),
    recompute=st.sampled_from(["none", "full"]),
)
def test_more_micro_batches_never_raise_the_bubble_fraction(split, tp, m, extra, recompute):
    model = dataclasses.replace(MODEL, layers=sum(split))
    cluster = cluster_of()

    def bubble(micro_batches):
        plan = parse_plan(
            {
                "model": "x",
                "global_batch": micro_batches,
                "recompute": recompute,
                "pipelines": [{"stages": [{"group": "g", "tp": tp, "layers": n} for n in split]}],
            }
        )
        return predict(plan, cluster, model).bubble_fraction

    assert bubble(m + extra) <= bubble(m) + 1e-12


def test_trace_has_every_operation_one_row_per_stage_and_opens_as_json(tmp_path):
    cluster = tmp_path / "c.yaml"
    cluster.write_text(
        "groups: [{name: g, accelerator: a100-80gb, nodes: 2, devices_per_node: 8}]\n"
    )
    trace = tmp_path / "trace.json"
    code = main(
        [
            "predict",
            "--cluster",
            str(cluster),
            "--model",
            "llama-7b",
            "--tp",
            "4",
            "--pp",
            "4",
            "--micro-batch",
            "1",
            "--global-batch",
            "8",
            "--json",
            "--trace",
            str(trace),
        ]
    )
    assert code == 0
    events = json.loads(trace.read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert sum(e["cat"] in ("forward", "backward") for e in slices) == 2 * 4 * 8
    assert sum(e["cat"] == "send" for e in slices) == 2 * 3 * 8
    assert {e["cat"] for e in slices} == {"forward", "backward", "send", "grad_sync", "optimizer"}
    rows = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {f"stage {s} · g" for s in range(4)} <= rows
    for e in slices:
        assert e["dur"] >= 0 and e["ts"] >= 0


def test_chrome_trace_separates_predicted_and_measured_timelines():
    events = [
        TimelineEvent(pipeline=0, stage=0, group="g", kind="forward", start_s=0, end_s=1, source=s)
        for s in ("predicted", "measured")
    ]
    names = {
        e["args"]["name"]
        for e in chrome_trace(events)["traceEvents"]
        if e["name"] == "process_name"
    }
    assert names == {"predicted · pipeline 0", "measured · pipeline 0"}
