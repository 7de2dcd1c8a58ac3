"""The rank topology: a pure function of plan and cluster, checked without processes."""

from __future__ import annotations

import math

import random_plans as plans
from hypothesis import given, settings
from hypothesis import strategies as st

from hethub.errors import SpecError
from hethub.spec import check_plan, parse_cluster, parse_model, parse_plan
from hethub.spec.buckets import MAIN_GRAD_BYTES, rank_buckets
from hethub.spec.parameters import parameter_table, stage_parameters
from hethub.spec.topology import build_topology, parameter_holders

CLUSTER = parse_cluster(
    {
        "groups": [
            {"name": "nv", "accelerator": "a100-80gb", "nodes": 2, "devices_per_node": 4},
            {"name": "amd", "accelerator": "mi250x", "nodes": 2, "devices_per_node": 4},
        ]
    },
    "t",
)
MODEL = parse_model(
    {
        "arch": "llama",
        "hidden": 64,
        "layers": 8,
        "heads": 8,
        "kv_heads": 4,
        "vocab": 128,
        "seq_len": 16,
    },
    "t",
    "m",
)


def test_hetero_plan_ranks_by_group_then_device():
    plan = parse_plan(
        {
            "model": "m",
            "global_batch": 6,
            "pipelines": [
                {
                    "count": 2,
                    "micro_batches": 2,
                    "stages": [
                        {"group": "nv", "tp": 2, "layers": 5},
                        {"group": "amd", "tp": 1, "layers": 3},
                    ],
                },
                {
                    "count": 1,
                    "micro_batches": 2,
                    "stages": [{"group": "amd", "tp": 4, "layers": 8}],
                },
            ],
        }
    )
    check_plan(plan, CLUSTER, MODEL)
    topo = build_topology(plan, CLUSTER)
    assert topo.world_size == 4 + 2 + 4
    assert [r.group for r in topo.ranks] == ["nv"] * 4 + ["amd"] * 6
    assert topo.stage_ranks(0, 0) == (0, 1) and topo.stage_ranks(1, 0) == (2, 3)
    # amd: the tp-4 block first (devices 0-3, node 0), then the two tp-1 stages (devices 4, 5)
    assert topo.stage_ranks(2, 0) == (4, 5, 6, 7)
    assert topo.stage_ranks(0, 1) == (8,) and topo.stage_ranks(1, 1) == (9,)
    holders = parameter_holders(topo, MODEL)
    # Each layer's gradient is summed over the leaders of every replica's stage holding it.
    assert holders["layers.6.qkv.weight"] == (4, 8, 9)
    assert holders["layers.0.qkv.weight"] == holders["embed.weight"] == (0, 2, 4)
    assert holders["head.weight"] == (4, 8, 9)
    assert {r.micro_batches for r in topo.ranks if r.replica == 2} == {2}


def random_plan(data):
    """A plan over the two groups with TP 1, 2 or 4, sharded or not."""
    shard = data.draw(st.booleans())
    return plans.random_plan(
        data, model="m", groups=("nv", "amd"), tps=(1, 2, 4), shard_optimizer=shard
    )


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_every_rank_once_tp_inside_a_node_and_every_layer_held_by_every_replica(data):
    plan = random_plan(data)
    try:
        check_plan(plan, CLUSTER, MODEL)
    except SpecError:
        return
    topo = build_topology(plan, CLUSTER)
    assert [r.rank for r in topo.ranks] == list(range(topo.world_size))
    assert len({(r.group, r.device) for r in topo.ranks}) == topo.world_size
    replicas = sum(p.count for p in plan.pipelines)
    for group in topo.tp_groups:
        assert len({(topo.ranks[k].group, topo.ranks[k].node) for k in group}) == 1
        assert [topo.ranks[k].tp_rank for k in group] == list(range(len(group)))
    holders = parameter_holders(topo, MODEL)
    assert set(holders) == set(parameter_table(MODEL))
    for name, leaders in holders.items():
        # one holding stage per replica (tiny llama ties nothing), each named by its leader
        assert len({topo.ranks[k].replica for k in leaders}) == len(leaders) == replicas, name
        assert all(topo.ranks[k].tp_rank == 0 for k in leaders)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), cap=st.sampled_from([1 << 10, 1 << 14, 25 << 20]))
def test_sync_buckets_cover_each_rank_s_shared_parameters_once_and_match_among_holders(data, cap):
    """spec.buckets.rank_buckets, the one bucket layout the runtime syncs and the predictor
    prices: every parameter a rank holds with another stage is in exactly one of its buckets,
    a bucket is over the cap only when it is one tensor, and the ranks of a holder set run
    that set's buckets in the same order with the same names (else their collectives would
    pair the wrong buffers)."""
    plan = random_plan(data)
    try:
        check_plan(plan, CLUSTER, MODEL)
    except SpecError:
        return
    topo = build_topology(plan, CLUSTER)
    holders = parameter_holders(topo, MODEL)
    table = parameter_table(MODEL)
    per_set: dict[tuple[int, ...], set[tuple[tuple[str, ...], ...]]] = {}
    for me in topo.ranks:
        buckets = rank_buckets(
            topo, MODEL, me.rank, peers_have_a_group=plan.shard_optimizer, cap=cap
        )
        held = {
            name
            for c in me.chunks
            for name in stage_parameters(
                MODEL, c.first_layer, c.layers, is_first=c.is_first, is_last=c.is_last
            )
        }
        named = [name for b in buckets for name in b.names]
        assert sorted(named) == sorted(n for n in held if len(holders[n]) > 1)
        for b in buckets:
            assert all(holders[name] == b.holders for name in b.names)
            full = sum(math.prod(table[name].shape) * MAIN_GRAD_BYTES for name in b.names)
            assert full <= cap or len(b.names) == 1
            if b.direct:  # summed among exactly the peers' stages
                assert len(b.holders) == len(topo.data_parallel_peers(me.rank))
        for leaders in {b.holders for b in buckets}:
            per_set.setdefault(leaders, set()).add(
                tuple(b.names for b in buckets if b.holders == leaders)
            )
    for leaders, layouts in per_set.items():
        assert len(layouts) == 1, leaders
