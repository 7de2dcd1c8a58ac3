"""The planner's pruning and caching change nothing it chooses: the same plans and the same upper
bound with every candidate drafted and predicted (search(prune=False)), and each floor it prunes
by is at most what it stands for."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hethub.planner import search, upper_bound
from hethub.planner.candidates import homogeneous, mixed
from hethub.planner.drafts import make_draft
from hethub.planner.floors import Floor, compute_floor, setting_floor, structure_floor
from hethub.planner.partition import least_bottleneck, relaxed_bottleneck, stage_times
from hethub.planner.search_state import SearchState, setting_of
from hethub.predictor import predict
from hethub.spec import parse_cluster, parse_model

# hethub.planner re-exports search(), which hides the module of that name from attribute access

LLAMA = {
    "arch": "llama",
    "hidden": 2048,
    "layers": 12,
    "heads": 16,
    "kv_heads": 4,
    "vocab": 32000,
    "seq_len": 2048,
}
GPT = {"arch": "gpt", "hidden": 1536, "layers": 6, "heads": 12, "vocab": 50304, "seq_len": 1024}
TIGHT = {
    "arch": "llama",
    "hidden": 4096,
    "layers": 16,
    "heads": 32,
    "vocab": 32000,
    "seq_len": 4096,
}

# (name, model, global batch, groups): two, three and four kinds, and one where memory caps bind
SCENARIOS = [
    ("two kinds", LLAMA, 8, [("nv", "a100-40gb", 4), ("amd", "mi210", 4)]),
    ("three kinds", GPT, 8, [("v", "v100", 2), ("a", "a100-80gb", 2), ("m", "mi250x", 4)]),
    (
        "four kinds",
        LLAMA,
        16,
        [("h", "h100", 2), ("a", "a100-80gb", 2), ("m", "mi300x", 2), ("g", "gaudi2", 2)],
    ),
    ("memory-bound", TIGHT, 32, [("small", "rtx3090", 8), ("big", "a100-80gb", 8)]),
]


def _scenario(model_fields, groups):
    model = parse_model(model_fields, "test", "m")
    cluster = parse_cluster(
        {"groups": [{"name": g, "accelerator": a, "devices_per_node": d} for g, a, d in groups]},
        "test",
    )
    return cluster, model


@pytest.mark.parametrize("name, model_fields, global_batch, groups", SCENARIOS)
def test_pruning_chooses_the_same_plans_and_bound(name, model_fields, global_batch, groups):
    cluster, model = _scenario(model_fields, groups)
    pruned = search(cluster, model, global_batch, model_ref="m")
    every = search(cluster, model, global_batch, model_ref="m", prune=False)
    assert pruned.best.plan == every.best.plan
    assert pruned.best.prediction == every.best.prediction
    assert {n: r and r.plan for n, r in pruned.group_best.items()} == {
        n: r and r.plan for n, r in every.group_best.items()
    }
    assert pruned.candidates_evaluated <= every.candidates_evaluated
    bound, bound_every = upper_bound(pruned), upper_bound(every)
    assert bound.to_json() == bound_every.to_json()
    assert {n: s.best and s.best.plan for n, s in bound.groups.items()} == {
        n: s.best and s.best.plan for n, s in bound_every.groups.items()
    }


def test_pruning_names_the_same_closest_overflow_when_nothing_fits():
    cluster, _ = _scenario(LLAMA, [("g", "rtx3090", 2)])
    model = parse_model({**TIGHT, "layers": 80, "hidden": 8192, "heads": 64}, "test", "m")
    pruned = search(cluster, model, 8, model_ref="m")
    every = search(cluster, model, 8, model_ref="m", prune=False)
    assert pruned.best is None and every.best is None
    assert pruned.closest == every.closest


def test_floors_are_at_most_the_drafts_bounds_and_the_predicted_steps():
    cluster, model = _scenario(*SCENARIOS[2][1::2])
    result = search(cluster, model, 16, model_ref="m")
    state = SearchState(cluster, model, "m", 16, float("inf"), None, result.query.calibration)
    jobs = [
        (setting, structure)
        for setting in {setting_of(state, r.plan) for r in result.ranked}
        for structure in itertools.chain(
            *([(layout,) for layout in homogeneous(g, model, 8)] for g in cluster.groups),
            mixed(cluster, model, {g.name: [1, 2] for g in cluster.groups}, 8, {}),
        )
    ]
    drafted = 0
    for setting, structure in jobs:
        tiers = Floor
        floors = [setting_floor(state, setting)] + [
            structure_floor(state, setting, structure, known)
            for known in (tiers.RELAXED, tiers.WHOLE, tiers.CAPPED)
        ]
        draft = make_draft(state, setting, structure, 1)
        if draft is None:
            continue
        assert all(floor <= draft.interleaved_bound for floor in floors)
        # the cheaper floors come first, and are lower
        assert all(a <= b * (1 + 1e-12) for a, b in itertools.pairwise(floors))
        drafted += 1
    assert drafted >= 50
    for ranked in result.ranked:  # interleaved, unlike layouts side by side, mixed replicas
        floor = compute_floor(state, ranked.plan)
        busiest = max(stage.compute_s for stage in ranked.prediction.stages)
        assert busiest * (1 - 1e-9) <= floor <= ranked.prediction.iteration_time_s
        assert ranked.prediction == predict(ranked.plan, cluster, model)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), p=st.integers(1, 4))
def test_least_bottleneck_is_the_least_slowest_stage_of_every_split(data, p):
    layers = data.draw(st.integers(p, 10))
    per_layer = data.draw(st.lists(st.floats(0.1, 3.0), min_size=p, max_size=p))
    extra = data.draw(st.lists(st.floats(0.0, 2.0), min_size=p, max_size=p))
    caps = data.draw(st.lists(st.integers(1, layers), min_size=p, max_size=p))
    slowest = [
        max(stage_times(list(split), per_layer, extra))
        for split in itertools.product(range(1, layers + 1), repeat=p)
        if sum(split) == layers and all(n <= c for n, c in zip(split, caps))
    ]
    found = least_bottleneck(layers, per_layer, extra, caps)
    if not slowest:
        assert found is None
    else:
        assert found == pytest.approx(min(slowest), rel=1e-12)
        assert relaxed_bottleneck(layers, per_layer, extra) <= found * (1 + 1e-12)
