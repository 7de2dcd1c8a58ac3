"""The predictor's price of issue 28's item 3: an overlapped sync across unlike layouts shows
only its exchange between them after the last backward, and an overlapped param gather only
what the next step's first forward does not cover. (The runtime's side: test_overlap_sync.)"""

from __future__ import annotations

import pytest

from hethub.errors import HethubError
from hethub.predictor import predict
from hethub.spec import load_model, parse_cluster, parse_plan

CLUSTER = parse_cluster(
    {
        "groups": [
            {"name": "nv", "accelerator": "a100-80gb", "nodes": 2, "devices_per_node": 8},
            {
                "name": "amd",
                "accelerator": "mi250x",
                "nodes": 2,
                "devices_per_node": 8,
                "network_gbps": 400,
            },
        ]
    },
    "test",
)
MODEL = load_model("llama-7b")
NV = {"count": 4, "micro_batches": 8, "stages": [{"group": "nv", "tp": 2, "layers": 16}] * 2}
AMD = {"count": 4, "micro_batches": 8, "stages": [{"group": "amd", "tp": 4, "layers": 32}]}


def _predict(layouts: list[dict], **fields):
    batch = sum(layout["count"] * layout["micro_batches"] for layout in layouts)
    plan = parse_plan({"model": "llama-7b", "global_batch": batch, **fields, "pipelines": layouts})
    return predict(plan, CLUSTER, MODEL, timeline=True)


def _ends(prediction, kind: str) -> dict[tuple[int, int], float]:
    return {(e.pipeline, e.stage): e.end_s for e in prediction.timeline if e.kind == kind}


def test_an_overlapped_cross_layout_sync_shows_only_its_exchange_after_the_last_backward():
    plain = _predict([NV, AMD])
    overlapped = _predict([NV, AMD], overlap_grad_sync=True)
    slowest = max(overlapped.pipeline_time_s)
    ends, plain_ends = _ends(overlapped, "grad_sync"), _ends(plain, "grad_sync")
    for index, layout in enumerate((NV, AMD)):
        # The layout alone: its replicas' own sum, overlapped as a one-layout plan's is.
        alone = _predict([layout])
        alone_ends = _ends(_predict([layout], overlap_grad_sync=True), "grad_sync")
        for s, stage in enumerate(alone.stages):
            (both,) = [x for x in overlapped.stages if (x.pipeline, x.position) == (index, s)]
            exchange = both.grad_sync_s - stage.grad_sync_s
            assert 0 < exchange < both.grad_sync_s
            # Inside the vendor as the layout alone; the exchange after the slowest layout.
            want = max(slowest, alone_ends[(0, s)]) + exchange
            assert ends[(index, s)] == pytest.approx(want, rel=1e-12)
            assert ends[(index, s)] < plain_ends[(index, s)]
    assert overlapped.iteration_time_s < plain.iteration_time_s


def test_an_overlapped_param_gather_hides_behind_the_first_forwards_up_to_their_length():
    sharded = _predict([NV, AMD], shard_optimizer=True)
    overlapped = _predict([NV, AMD], shard_optimizer=True, overlap_param_gather=True)
    shown = {
        (e.pipeline, e.stage): e.end_s - e.start_s
        for e in overlapped.timeline
        if e.kind == "param_gather"
    }
    assert {(e.pipeline, e.stage) for e in sharded.timeline if e.kind == "param_gather"} == {
        (0, 0),
        (0, 1),
        (1, 0),
    }
    # The AMD stage's gather (4 replicas of a whole 7B model, across its nodes' 400 Gbit/s)
    # outlasts its first forward: only the rest shows. The NV stages' halves hide whole: behind
    # stage 0's forward, and stage 1's wait for it.
    (amd,) = [s for s in overlapped.stages if s.pipeline == 1]
    assert amd.param_gather_s > amd.forward_s
    assert shown == {(1, 0): pytest.approx(amd.param_gather_s - amd.forward_s, rel=1e-12)}
    assert overlapped.iteration_time_s == pytest.approx(
        sharded.iteration_time_s - amd.forward_s, rel=1e-12
    )


def test_an_overlapped_param_gather_needs_a_sharded_optimizer_and_round_trips():
    with pytest.raises(HethubError, match="overlap_param_gather.*needs shard_optimizer: true"):
        _predict([AMD], overlap_param_gather=True)
    plan = parse_plan(
        {
            "model": "llama-7b",
            "global_batch": 32,
            "shard_optimizer": True,
            "overlap_param_gather": True,
            "pipelines": [AMD],
        }
    )
    assert parse_plan(plan.to_dict()) == plan
    assert "overlapped param gather" in plan.summary()
