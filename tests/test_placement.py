"""Placement: every stage's devices, the same for the predictor and the runtime."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hethub.errors import SpecError
from hethub.spec import parse_cluster, parse_plan
from hethub.spec.placement import place

CLUSTER = parse_cluster(
    {
        "groups": [
            {"name": "a", "accelerator": "h100", "nodes": 4, "devices_per_node": 8},
            {"name": "b", "accelerator": "mi300x", "nodes": 4, "devices_per_node": 8},
        ]
    },
    "t",
)


def _plan(pipelines, layers=8):
    for p in pipelines:
        p.setdefault("micro_batches", 1)
    return parse_plan(
        {
            "model": "x",
            "global_batch": sum(p["count"] * p["micro_batches"] for p in pipelines),
            "pipelines": pipelines,
        }
    )


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_blocks_are_disjoint_inside_their_group_and_tp_never_straddles_a_node(data):
    pipelines = []
    for _ in range(data.draw(st.integers(1, 3))):
        stages = [
            {
                "group": data.draw(st.sampled_from("ab")),
                "tp": data.draw(st.sampled_from([1, 2, 4, 8])),
                "layers": 1,
            }
            for _ in range(data.draw(st.integers(1, 4)))
        ]
        pipelines.append({"count": data.draw(st.integers(1, 3)), "stages": stages})
    plan = _plan(pipelines)
    try:
        blocks = place(plan, CLUSTER)
    except SpecError:
        return  # more devices than the groups have: refused, never overlapped
    taken = {"a": set(), "b": set()}
    for layout, pipeline in zip(blocks, plan.pipelines):
        assert [b.tp for b in layout] == [s.tp for s in pipeline.stages]
        for block in layout:
            for replica in range(block.replicas):
                devices = set(block.devices(replica))
                assert not devices & taken[block.group]
                taken[block.group] |= devices
                assert len({d // 8 for d in devices}) == 1  # one node per TP group
            assert max(taken[block.group]) < 32


def test_stage_major_replicas_of_a_stage_are_side_by_side():
    plan = _plan(
        [
            {
                "count": 2,
                "stages": [
                    {"group": "a", "tp": 2, "layers": 4},
                    {"group": "a", "tp": 2, "layers": 4},
                ],
            }
        ]
    )
    first, second = place(plan, CLUSTER)[0]
    assert list(first.devices(0)) == [0, 1] and list(first.devices(1)) == [2, 3]
    assert list(second.devices(0)) == [4, 5] and list(second.devices(1)) == [6, 7]


def test_a_tp_group_that_would_straddle_two_nodes_moves_to_the_next_and_overflow_is_refused():
    six = parse_cluster(
        {"groups": [{"name": "a", "accelerator": "h100", "nodes": 2, "devices_per_node": 6}]}, "t"
    )
    plan = _plan(
        [
            {
                "count": 1,
                "stages": [
                    {"group": "a", "tp": 2, "layers": 1},
                    {"group": "a", "tp": 3, "layers": 1},
                    {"group": "a", "tp": 2, "layers": 1},
                    {"group": "a", "tp": 3, "layers": 1},
                ],
            }
        ]
    )
    # widest first: tp3 at 0-2 and 3-5 (node 0), then tp2 at 6-7 and 8-9 (node 1)
    assert [b.first_device for b in place(plan, six)[0]] == [6, 0, 8, 3]
    packed = _plan(
        [
            {"count": 3, "stages": [{"group": "a", "tp": 3, "layers": 1}]},
            {"count": 1, "stages": [{"group": "a", "tp": 2, "layers": 1}]},
        ]
    )
    blocks = place(packed, six)
    assert list(blocks[0][0].starts) == [0, 3, 6] and blocks[1][0].first_device == 9
    with pytest.raises(SpecError, match="at most the group's 12 devices"):
        place(
            _plan(
                [
                    {"count": 3, "stages": [{"group": "a", "tp": 3, "layers": 1}]},
                    {"count": 2, "stages": [{"group": "a", "tp": 2, "layers": 1}]},
                ]
            ),
            six,
        )
