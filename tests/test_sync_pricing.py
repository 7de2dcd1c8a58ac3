"""Who syncs gradients with whom, and in which buckets, is spec.topology's and spec.buckets'
answer, read by the predictor: its data-parallel degrees are the topology's peers, and its
profiled sync prices exactly the buckets the runtime syncs (rank_buckets)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from random_plans import random_plan

from hethub.errors import SpecError
from hethub.predictor import predict
from hethub.profiles import LinkProfile, empty_profiles
from hethub.spec import check_plan, load_model, parse_cluster, parse_plan
from hethub.spec.buckets import MAIN_GRAD_BYTES, rank_buckets
from hethub.spec.parameters import parameter_table
from hethub.spec.topology import build_topology, data_parallel_degrees, layout_classes

CPU = parse_cluster(
    {"groups": [{"name": "cpu", "accelerator": "cpu", "nodes": 1, "devices_per_node": 16}]}
)
TWO = parse_cluster(
    {
        "groups": [
            {"name": "a", "accelerator": "cpu", "nodes": 1, "devices_per_node": 8},
            {"name": "b", "accelerator": "cpu", "nodes": 1, "devices_per_node": 8},
        ]
    }
)
LATENCY = 1e12
"""Seconds a collective over r ranks costs r times, besides a second per byte: a priced sync
then reads back as (sum of its collectives' ranks) x LATENCY + its bytes, exactly."""


def _link(ranks: int) -> LinkProfile:
    fits = {r: (r * LATENCY, 1.0) for r in range(2, 17)}
    return LinkProfile(
        device="cpu",
        concurrent_ranks=ranks,
        p2p_latency_s=1e-5,
        p2p_bytes_per_s=1e9,
        allreduce=fits,
        broadcast=fits,
        allgather=fits,
        reducescatter=fits,
        measured_at="2025-01-01",
    )


def _plan(model: str, pipelines: list[dict], **extra):
    micro = sum(p["count"] * p.get("micro_batches", 2) for p in pipelines)
    return parse_plan(
        {
            "model": model,
            "global_batch": micro,
            "precision": "fp32",
            **extra,
            "pipelines": [{"micro_batches": 2, **p} for p in pipelines],
        }
    )


def _stages(*layers: int, group: str = "cpu") -> list[dict]:
    return [{"group": group, "tp": 1, "layers": n} for n in layers]


PLANS = {
    # one layout, buckets cut at 25 MB (gpt-1.3b's layers are 50 MB each)
    "gpt-1.3b dp2": ("gpt-1.3b", [{"count": 2, "stages": _stages(24)}], {}),
    # the tied embedding is summed over both ends of every replica
    "tiny-gpt pp2 dp2": ("tiny-gpt", [{"count": 2, "stages": _stages(3, 5)}], {}),
    # the one-stage layout sums its first half with one stage of the other, its second half
    # with the other: two holder sets of two leaders each
    "tiny-llama unlike": (
        "tiny-llama",
        [{"count": 1, "stages": _stages(8)}, {"count": 1, "stages": _stages(4, 4)}],
        {},
    ),
    "tiny-gpt unlike": (
        "tiny-gpt",
        [{"count": 1, "stages": _stages(8)}, {"count": 2, "stages": _stages(2, 6)}],
        {},
    ),
    # direct buckets: summed among the data-parallel peers, each its own shards
    "tiny-llama pp2 dp2 overlapped": (
        "tiny-llama",
        [{"count": 2, "stages": _stages(5, 3)}],
        {"overlap_grad_sync": True},
    ),
    "tiny-gpt interleaved dp2": (
        "tiny-gpt",
        [
            {
                "count": 2,
                "virtual_stages": 2,
                "stages": [{"group": "cpu", "tp": 1, "layers": [2, 2]}] * 2,
            }
        ],
        {"schedule": "interleaved-1f1b"},
    ),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_the_profiled_sync_prices_the_runtime_s_buckets(name: str) -> None:
    preset, pipelines, extra = PLANS[name]
    model, plan = load_model(preset), _plan(preset, pipelines, **extra)
    check_plan(plan, CPU, model)
    topology = build_topology(plan, CPU)
    profiles = empty_profiles("test").merged([_link(topology.world_size)])
    profiles = profiles.select(concurrent_ranks=topology.world_size)
    prediction = predict(plan, CPU, model, profiles=profiles)
    table = parameter_table(model)
    replica = 0
    for index, pipeline in enumerate(plan.pipelines):
        for s in range(len(pipeline.stages)):
            leader = topology.stage_ranks(replica, s)[0]
            buckets = rank_buckets(
                topology,
                model,
                leader,
                peers_have_a_group=plan.shard_optimizer or plan.overlap_grad_sync,
            )
            ranks = sum(len(b.holders) for b in buckets)
            nbytes = sum(
                math.prod(table[n].shape) * MAIN_GRAD_BYTES for b in buckets for n in b.names
            )
            (stage,) = [p for p in prediction.stages if (p.pipeline, p.position) == (index, s)]
            assert stage.grad_sync_s == ranks * LATENCY + nbytes, (name, index, s)
        replica += pipeline.count
    if name == "gpt-1.3b dp2":  # more than one bucket, each within the cap or one tensor
        assert len(rank_buckets(topology, model, 0, peers_have_a_group=False)) > 1


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_the_data_parallel_degrees_are_the_topology_s_peers(data) -> None:
    plan = random_plan(data, model="tiny-llama", groups=("a", "b"), tps=(1, 2))
    try:
        check_plan(plan, TWO, load_model("tiny-llama"))
    except SpecError:
        return
    topology = build_topology(plan, TWO)
    classes, degrees = layout_classes(plan), data_parallel_degrees(plan)
    for rank in topology.ranks:
        assert rank.layout_class == classes[rank.pipeline]
        assert len(topology.data_parallel_peers(rank.rank)) == degrees[rank.pipeline]
