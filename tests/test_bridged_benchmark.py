"""benchmarks/local_runs.py's bridged plans: this CPU's profiles, stored again under two vendors'
names, price a plan across them wholly from measurements (nothing left to the analytic model),
as benchmarks/predictor_vs_runtime.py's bridge-* plans need."""

from __future__ import annotations

import dataclasses

import pytest
from benchmark_scripts import load_benchmark
from test_profile import TINY, key_of, layer_profile, link_profile

from hethub.predictor import predict
from hethub.predictor.profiled import grad_sync_time, missing_profiles, sync_collectives
from hethub.profiles import load_profiles, save_profile
from hethub.spec import parse_cluster, parse_plan
from hethub.spec.collectives import BRIDGE, Kind

BRIDGED = {
    "groups": [
        {"name": "nv", "accelerator": "a100-80gb", "nodes": 1, "devices_per_node": 1},
        {"name": "amd", "accelerator": "mi250x", "nodes": 1, "devices_per_node": 1},
    ]
}
PP_ACROSS = parse_plan(
    {
        "model": "tiny-llama",
        "global_batch": 4,
        "micro_batch": 1,
        "precision": "fp32",
        "pipelines": [
            {
                "count": 1,
                "stages": [
                    {"group": "nv", "tp": 1, "layers": 2},
                    {"group": "amd", "tp": 1, "layers": 2},
                ],
            }
        ],
    }
)


def test_the_cpu_profiles_under_two_vendors_names_price_a_plan_across_them(tmp_path):
    local_runs = load_benchmark("local_runs")
    cpu_link = link_profile(2)
    save_profile(tmp_path / "cpu", layer_profile(key_of(TINY, concurrent_ranks=2)))
    save_profile(tmp_path / "cpu", cpu_link)
    kinds = ["a100-80gb", "mi250x"]
    folder = local_runs.profiles_for_kinds(tmp_path / "cpu", tmp_path / "bridged", kinds)
    profiles = load_profiles(folder).select(dtype="fp32", threads=1, concurrent_ranks=2)
    cluster = parse_cluster(BRIDGED, "bridged")
    assert missing_profiles(PP_ACROSS, cluster, TINY, profiles) == []
    between = profiles.link_between("mi250x", "a100-80gb")  # either way round
    assert between is not None and between.peer is not None
    assert between.p2p_bytes_per_s == cpu_link.p2p_bytes_per_s
    # each stage's compute is the CPU's own profile's, as on the all-CPU twin
    twin = parse_cluster(local_runs.cpu_twin(BRIDGED), "twin")
    cpu = load_profiles(tmp_path / "cpu").select(dtype="fp32", threads=1, concurrent_ranks=2)
    bridged = predict(PP_ACROSS, cluster, TINY, profiles=profiles)
    alone = predict(PP_ACROSS, twin, TINY, profiles=cpu)
    assert [s.compute_s for s in bridged.stages] == [s.compute_s for s in alone.stages]


DP_ACROSS = parse_plan(
    {
        "model": "tiny-llama",
        "global_batch": 2,
        "micro_batch": 1,
        "precision": "fp32",
        "pipelines": [
            {"count": 1, "stages": [{"group": "nv", "tp": 1, "layers": 4}]},
            {"count": 1, "stages": [{"group": "amd", "tp": 1, "layers": 4}]},
        ],
    }
)


def test_a_bridged_sync_is_priced_as_a_ring_over_the_link_between_the_kinds():
    cluster = parse_cluster(BRIDGED, "bridged")
    collectives = sync_collectives(DP_ACROSS, cluster, TINY, 0, 0)
    bridged = [c for c in collectives if c.path == BRIDGE]
    assert bridged and all(c.kind is Kind.ALL_REDUCE and c.ranks == 2 for c in bridged)
    link = link_profile(2)
    # no link measured between the kinds: not priced from profiles (the analytic model's)
    assert grad_sync_time(link, collectives) is None
    between = dataclasses.replace(link_profile(2), device="a100-80gb", peer="mi250x")
    priced = grad_sync_time(link, collectives, [between])
    # each bridged all-reduce over 2 ranks: a ring's 2 messages of half the bucket each
    expected = sum(2 * between.p2p_time(c.nbytes / 2) for c in bridged)
    assert priced.reduce_s == pytest.approx(expected)
    assert priced.exchange_s == pytest.approx(expected)  # it waits for both vendors' backwards
