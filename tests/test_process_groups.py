"""The job's process groups: listed by a pure function, created in one place, in one order."""

from __future__ import annotations

import pytest

from hethub.runtime.process_groups import (
    BRIDGE_BACKEND,
    Role,
    create_groups,
    job_groups,
    vendor_parts,
)
from hethub.runtime.spawn import run_ranks
from hethub.spec import check_plan, load_model, parse_cluster, parse_plan
from hethub.spec.topology import build_topology, parameter_holders

CLUSTER = parse_cluster(
    {
        "groups": [
            {"name": "nv", "accelerator": "a100-80gb", "nodes": 1, "devices_per_node": 4},
            {"name": "amd", "accelerator": "mi250x", "nodes": 1, "devices_per_node": 4},
        ]
    },
    "test",
)
MODEL = load_model("tiny-llama")
# Replica 0: nv TP 2 (layers 0-4) -> amd TP 1 (5-7); replica 1: amd TP 2, all 8 layers.
PLAN = parse_plan(
    {
        "model": "tiny-llama",
        "global_batch": 4,
        "pipelines": [
            {
                "count": 1,
                "micro_batches": 2,
                "stages": [
                    {"group": "nv", "tp": 2, "layers": 5},
                    {"group": "amd", "tp": 1, "layers": 3},
                ],
            },
            {"count": 1, "micro_batches": 2, "stages": [{"group": "amd", "tp": 2, "layers": 8}]},
        ],
    }
)


def topology():
    check_plan(PLAN, CLUSTER, MODEL)
    return build_topology(PLAN, CLUSTER)


def test_the_job_lists_its_tp_pipeline_sync_and_vendor_groups():
    topo = topology()
    assert [r.group for r in topo.ranks] == ["nv", "nv", "amd", "amd", "amd"]
    vendors = topo.vendors(CLUSTER)
    specs = job_groups(topo, MODEL, vendors, ["gloo"] * topo.world_size)
    by_role = {}
    for spec in specs:
        by_role.setdefault(spec.role, []).append(spec.ranks)
    assert by_role[Role.WORLD] == [(0, 1, 2, 3, 4)]
    assert by_role[Role.TENSOR] == [(0, 1), (2, 3)]  # the amd TP-1 stage needs no group
    assert by_role[Role.PIPELINE] == [(0, 4)]  # stage leaders 0 (nv) and 4 (amd)
    # layers 0-4 and the embedding: leaders 0 (nv) and 2 (amd), one per vendor: only the
    # bridge; layers 5-7 and the head: 2 and 4, both amd: natively
    assert sorted(set(parameter_holders(topo, MODEL).values())) == [(0, 2), (2, 4)]
    assert by_role[Role.GRAD_SYNC] == [(2, 4)]
    assert by_role[Role.SYNC_BRIDGE] == [(0, 2)]
    assert Role.SYNC_LOCAL not in by_role
    assert by_role[Role.VENDOR] == [(0, 1), (2, 3, 4)]
    assert len(specs) == len({(s.role, s.ranks) for s in specs})


def test_a_group_is_native_only_where_all_its_ranks_share_a_vendor_and_a_backend():
    topo = topology()
    vendors = topo.vendors(CLUSTER)
    # nv ranks on CUDA (nccl), the amd ones on the CPU of this machine (gloo)
    backends = ["nccl", "nccl", "gloo", "gloo", "gloo"]
    backend = {(s.role, s.ranks): s.backend for s in job_groups(topo, MODEL, vendors, backends)}
    assert backend[(Role.TENSOR, (0, 1))] == "nccl"
    assert backend[(Role.TENSOR, (2, 3))] == "gloo"
    assert backend[(Role.PIPELINE, (0, 4))] == BRIDGE_BACKEND  # across vendors
    assert backend[(Role.VENDOR, (0, 1))] == "nccl"
    # two vendors on one backend name (RCCL is torch's nccl on ROCm) still cannot talk natively
    all_nccl = job_groups(topo, MODEL, vendors, ["nccl"] * 5)
    sync = {(s.role, s.ranks): s.backend for s in all_nccl if "sync" in s.role}
    assert sync == {(Role.SYNC_BRIDGE, (0, 2)): BRIDGE_BACKEND, (Role.GRAD_SYNC, (2, 4)): "nccl"}
    assert {s.backend for s in all_nccl if s.role is Role.TENSOR} == {"nccl"}


def test_a_sync_set_spanning_vendors_is_split_into_native_parts_and_a_bridge():
    # 2 nv replicas and 2 amd replicas of the whole model: one sync set of four leaders
    plan = parse_plan(
        {
            "model": "tiny-llama",
            "global_batch": 4,
            "pipelines": [
                {"count": 2, "stages": [{"group": "nv", "tp": 1, "layers": 8}]},
                {"count": 2, "stages": [{"group": "amd", "tp": 1, "layers": 8}]},
            ],
        }
    )
    check_plan(plan, CLUSTER, MODEL)
    topo = build_topology(plan, CLUSTER)
    vendors = topo.vendors(CLUSTER)
    assert vendor_parts((0, 1, 2, 3), vendors) == ((0, 1), (2, 3))
    specs = job_groups(topo, MODEL, vendors, ["nccl"] * 4)
    sync = [(s.role, s.ranks, s.backend) for s in specs if "sync" in s.role]
    assert sync == [
        (Role.SYNC_LOCAL, (0, 1), "nccl"),
        (Role.SYNC_LOCAL, (2, 3), "nccl"),
        (Role.SYNC_BRIDGE, (0, 2), BRIDGE_BACKEND),
    ]


def _create(rank, world):
    import torch
    import torch.distributed as dist

    topo = topology()
    specs = job_groups(topo, MODEL, topo.vendors(CLUSTER), ["gloo"] * world)
    groups = create_groups(specs)
    mine = {}
    for spec in specs:
        if rank in spec.ranks:
            handle = groups.get(spec.role, spec.ranks)
            mine[f"{spec.role}{spec.ranks}"] = dist.get_process_group_ranks(handle)
            # the group works: a sum over it is the number of its ranks
            one = torch.ones(1)
            dist.all_reduce(one, group=handle)
            assert one.item() == len(spec.ranks)
    return mine


@pytest.mark.slow
def test_every_rank_creates_the_listed_groups_and_holds_its_own():
    got = run_ranks(_create, 5, timeout_s=120, purpose="test")
    assert got[4] == {
        "world(0, 1, 2, 3, 4)": [0, 1, 2, 3, 4],
        "pipeline(0, 4)": [0, 4],
        "grad_sync(2, 4)": [2, 4],
        "vendor(2, 3, 4)": [2, 3, 4],
    }
    assert set(got[1]) == {"world(0, 1, 2, 3, 4)", "tensor(0, 1)", "vendor(0, 1)"}
