"""Why a plan beats the upper bound is read off the plans: the replicas of the plan and of each
group alone, and each advantage only where the plans show it."""

from __future__ import annotations

import dataclasses

from hethub.planner import search, upper_bound
from hethub.planner.above_bound import why_above
from hethub.spec import parse_cluster, parse_model

MODEL = parse_model(
    {
        "arch": "llama",
        "hidden": 4096,
        "layers": 16,
        "heads": 32,
        "vocab": 32000,
        "seq_len": 4096,
    },
    "test",
    "m",
)
CLUSTER = parse_cluster(
    {
        "groups": [
            {"name": "small", "accelerator": "rtx3090", "devices_per_node": 8},
            {"name": "big", "accelerator": "a100-80gb", "devices_per_node": 8},
        ]
    },
    "test",
)


def test_the_reasons_name_the_plans_replicas_and_only_what_the_plans_show():
    result = search(CLUSTER, MODEL, 32, model_ref="m")
    bound = upper_bound(result)
    best = result.best
    lines = why_above(bound, best, CLUSTER)
    for pipeline in best.plan.pipelines:
        assert f"{pipeline.count} x " in lines[0]
        assert f"{pipeline.micro_batches} micro-batches each" in lines[0]
    for name, share in bound.groups.items():
        if share.best is not None:
            assert f"{name}: " in lines[0]
    alone = [s.best.prediction for s in bound.groups.values() if s.best is not None]
    idle_alone = sum(p.devices * p.bubble_fraction for p in alone) / sum(p.devices for p in alone)
    assert any("idles" in line for line in lines) == (best.prediction.bubble_fraction < idle_alone)
    # the same plan with all its work on one micro-batch size larger: said, with both sizes
    bigger = dataclasses.replace(
        best, plan=dataclasses.replace(best.plan, micro_batch=2 * best.plan.micro_batch)
    )
    said = [line for line in why_above(bound, bigger, CLUSTER) if "micro-batch is" in line]
    assert said and f"is {2 * best.plan.micro_batch} sequences" in said[0]
    assert not any("micro-batch is" in line for line in lines[1:]) or any(
        best.plan.micro_batch > s.best.plan.micro_batch
        for s in bound.groups.values()
        if s.best is not None
    )
