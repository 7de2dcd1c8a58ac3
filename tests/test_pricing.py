"""One interface for where a cost comes from (predictor.pricing): the analytic model, or measured
profiles with the analytic model for what they lack."""

from __future__ import annotations

import pytest

from hethub.predictor import default_calibration
from hethub.predictor.pricing import (
    AnalyticPricing,
    Boundary,
    ProfiledPricing,
    StageShape,
    SyncPeers,
    pricing_for,
)
from hethub.predictor.stage import StagePosition
from hethub.profiles import LayerKey, LayerProfile, LinkProfile, empty_profiles
from hethub.spec import load_model, parse_cluster, parse_plan
from hethub.spec.parameters import parameter_count
from hethub.spec.plan import Precision, Recompute

TINY = load_model("tiny-llama")
CPU = parse_cluster(
    {"groups": [{"name": "cpu", "accelerator": "cpu", "nodes": 1, "devices_per_node": 2}]}
)
GROUP = CPU.groups[0]
CAL = default_calibration()
PLAN = parse_plan(
    {
        "model": "tiny-llama",
        "global_batch": 2,
        "precision": "fp32",
        "pipelines": [{"count": 2, "stages": [{"group": "cpu", "tp": 1, "layers": 8}]}],
    }
)
SHAPE = StageShape(
    model=TINY,
    layers=8,
    tp=1,
    position=StagePosition.of(0, 1),
    micro_batch=1,
    recompute=Recompute.NONE,
    precision=Precision.FP32,
)
PEERS = SyncPeers(
    plan=PLAN, cluster=CPU, pipeline=0, stage=0, replicas=2, classes=1, fewest=2, cross_bw=0.0
)
BOUNDARY = Boundary(
    cluster=CPU,
    model=TINY,
    micro_batch=1,
    precision=Precision.FP32,
    sender=GROUP,
    receiver=GROUP,
    tp_sender=1,
    tp_receiver=1,
    across_nodes=False,
)


def _profiles(*items):
    return empty_profiles("test").merged(list(items)).select(concurrent_ranks=2)


def _layer() -> LayerProfile:
    key = LayerKey.of(
        TINY, device="cpu", dtype="fp32", threads=1, concurrent_ranks=2, tp=1, micro_batch=1
    )
    return LayerProfile(
        key=key,
        layer_forward_s=0.01,
        layer_backward_s=0.02,
        embed_forward_s=0.001,
        embed_backward_s=0.002,
        head_forward_s=0.003,
        head_backward_s=0.004,
        optimizer_s_per_param=1e-9,
        layer_activation_bytes=1_000_000,
        layer_param_bytes=200_000,
        measured_at="2025-01-01",
    )


def _link() -> LinkProfile:
    fit = (1e-4, 1e9)
    return LinkProfile(
        device="cpu",
        concurrent_ranks=2,
        p2p_latency_s=5e-5,
        p2p_bytes_per_s=2e9,
        allreduce={2: fit},
        broadcast={2: fit},
        allgather={2: fit},
        measured_at="2025-01-01",
    )


def _costs(pricing):
    return (
        pricing.work(GROUP, SHAPE),
        pricing.send(BOUNDARY),
        pricing.sync(GROUP, SHAPE, PEERS),
        pricing.optimizer_s(GROUP, SHAPE),
        pricing.memory(GROUP, SHAPE, in_flight=1, optimizer_shards=1),
        pricing.loss_sync_s(PLAN, CPU),
    )


def test_profiles_are_priced_from_what_they_hold_and_the_rest_analytically() -> None:
    analytic = pricing_for(CAL, None)
    assert isinstance(analytic, AnalyticPricing) and analytic.loss_sync_s(PLAN, CPU) is None
    # profiles holding nothing of this plan price it as the analytic model does
    assert _costs(pricing_for(CAL, _profiles())) == _costs(analytic)
    measured = pricing_for(CAL, _profiles(_layer(), _link()))
    assert isinstance(measured, ProfiledPricing)
    work, send, sync, optimizer, memory, loss = _costs(measured)
    assert work.forward_s == pytest.approx(8 * 0.01 + 0.001 + 0.003)
    assert send.forward_s == pytest.approx(_link().p2p_time(TINY.seq_len * TINY.hidden * 4))
    assert sync != _costs(analytic)[2] and sync.gather_s == 0.0
    assert optimizer == pytest.approx(1e-9 * parameter_count(TINY))  # measured per parameter
    assert memory.activations_gb != _costs(analytic)[4].activations_gb
    assert loss == _link().allreduce_time(4, 2)


def test_a_group_s_emulated_speed_stretches_either_pricing_s_work() -> None:
    half_speed = {"name": "s", "accelerator": "cpu", "devices_per_node": 2, "speed": 0.5}
    slow = parse_cluster({"groups": [half_speed]}).groups[0]
    for pricing in (pricing_for(CAL, None), pricing_for(CAL, _profiles(_layer()))):
        fast, half = pricing.work(GROUP, SHAPE), pricing.work(slow, SHAPE)
        assert half.forward_s == pytest.approx(2 * fast.forward_s)
        assert half.backward_s == pytest.approx(2 * fast.backward_s)
