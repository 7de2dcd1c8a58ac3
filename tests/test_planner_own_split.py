"""The upper bound weighs the split of the batch that the planner's own plan makes: where each
of the plan's replicas lies in one group, each group planned alone on its part of that plan's
batch is a split the bound's maximum must be at least."""

from __future__ import annotations

import dataclasses
import sys

from hethub.planner import search, upper_bound
from hethub.spec import parse_cluster, parse_model

# hethub.planner re-exports upper_bound(), which hides the module of that name
bound_module = sys.modules["hethub.planner.bound"]

GPT = {"arch": "gpt", "hidden": 1536, "layers": 6, "heads": 12, "vocab": 50304, "seq_len": 1024}
GROUPS = [("v", "v100", 2), ("a", "a100-80gb", 2), ("m", "mi250x", 4)]


def _cluster():
    return parse_cluster(
        {"groups": [{"name": g, "accelerator": a, "devices_per_node": d} for g, a, d in GROUPS]},
        "test",
    )


def _alone_sum(cluster, model, shares):
    total = 0.0
    for name, share in shares.items():
        if share:
            alone = dataclasses.replace(
                cluster, groups=(cluster.group(name),), cross_group_gbps=None
            )
            total += search(alone, model, share, model_ref="m").best.prediction.tokens_per_s
    return total


def test_the_bound_is_at_least_the_plans_own_split(monkeypatch):
    cluster, model = _cluster(), parse_model(GPT, "test", "m")
    result = search(cluster, model, 8, model_ref="m")
    shares = bound_module._plan_shares(result.best.plan, [g.name for g in cluster.groups])
    assert shares is not None and sum(shares.values()) == 8  # every replica in one group
    expected = _alone_sum(cluster, model, shares)
    assert upper_bound(result).tokens_per_s >= expected * (1 - 1e-12)
    # With no climb at all (and no planning of every share), the bound is that split, each
    # term the search's own.
    monkeypatch.setattr(bound_module, "MAX_ROUNDS", 0)
    monkeypatch.setattr(bound_module, "EVERY_SHARE", 0)
    bound = upper_bound(result)
    assert {name: g.global_batch for name, g in bound.groups.items()} == shares
    assert bound.tokens_per_s == expected


def test_a_replica_across_groups_is_no_groups_share():
    cluster, model = _cluster(), parse_model(GPT, "test", "m")
    plan = search(cluster, model, 8, model_ref="m").best.plan
    first = plan.pipelines[0]
    other = next(name for name, _, _ in GROUPS if name != first.stages[0].group)
    crossing = dataclasses.replace(
        first, stages=(*first.stages, dataclasses.replace(first.stages[-1], group=other))
    )
    mixed = dataclasses.replace(plan, pipelines=(crossing, *plan.pipelines[1:]))
    assert bound_module._plan_shares(mixed, [name for name, _, _ in GROUPS]) is None
