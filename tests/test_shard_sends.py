"""Pipeline sends by shard (runtime.p2p): each TP rank sends its own run of an activation or
gradient, the receiving stage all-gathers it, between unlike TP degrees the runs re-cut with no
leader; what each rank counts is the plan of a step's transfers; and both pricings price what
runs."""

from __future__ import annotations

import pytest
import torch
from test_profile import link_profile

from hethub.comm import BRIDGE, NATIVE, Communicator
from hethub.predictor.calibration import default_calibration
from hethub.predictor.pricing import AnalyticPricing, Boundary
from hethub.predictor.profiled import send_times
from hethub.runtime.p2p import StageLinks
from hethub.runtime.process_groups import create_groups, job_groups, rank_groups
from hethub.runtime.spawn import run_ranks
from hethub.spec import load_model, parse_cluster, parse_plan
from hethub.spec.collectives import (
    Kind,
    MessageCut,
    Phase,
    Piece,
    message_cut,
    rank_transfers,
    shard_degrees,
    shard_pieces,
)
from hethub.spec.plan import Precision
from hethub.spec.topology import build_topology

CLUSTER = parse_cluster(
    {
        "groups": [
            {"name": "nv", "accelerator": "a100-80gb", "nodes": 1, "devices_per_node": 4},
            {"name": "amd", "accelerator": "mi250x", "nodes": 1, "devices_per_node": 4},
        ]
    },
    "test",
)
# Two replicas: TP 2 -> TP 2 across the bridge, and TP 1 -> TP 2 (one sender, re-cut).
PLAN = {
    "model": "tiny-llama",
    "micro_batch": 2,
    "global_batch": 4,
    "pipelines": [
        {
            "count": 1,
            "micro_batches": 1,
            "stages": [
                {"group": "nv", "tp": 2, "layers": 4},
                {"group": "amd", "tp": 2, "layers": 4},
            ],
        },
        {
            "count": 1,
            "micro_batches": 1,
            "stages": [
                {"group": "nv", "tp": 1, "layers": 4},
                {"group": "amd", "tp": 2, "layers": 4},
            ],
        },
    ],
}
SHAPE = (2, 64, 64)  # (B, T, h): tiny-llama's seq_len and hidden, two sequences


def test_like_degrees_pair_each_tp_rank_with_its_peer() -> None:
    assert shard_pieces(8, 2, 2) == [Piece(0, 0, 0, 4), Piece(1, 1, 4, 8)]


def test_unlike_degrees_recut_the_slices_among_every_overlapping_pair() -> None:
    # 1 -> 2: the one sender sends each receiver its half; 4 -> 2: each receiver takes two
    assert shard_pieces(8, 1, 2) == [Piece(0, 0, 0, 4), Piece(0, 1, 4, 8)]
    assert shard_pieces(8, 4, 2) == [
        Piece(0, 0, 0, 2),
        Piece(1, 0, 2, 4),
        Piece(2, 1, 4, 6),
        Piece(3, 1, 6, 8),
    ]
    # 2 -> 3 on a sequence of 6: the middle receiver takes from both senders
    assert shard_pieces(6, 2, 3) == [
        Piece(0, 0, 0, 2),
        Piece(0, 1, 2, 3),
        Piece(1, 1, 3, 4),
        Piece(1, 2, 4, 6),
    ]


def test_a_message_a_stage_cannot_cut_goes_whole_from_rank_0_or_to_every_rank() -> None:
    assert shard_pieces(6, 4, 2) == [Piece(0, 0, 0, 3), Piece(0, 1, 3, 6)]
    # 6 elements cannot be cut among 4: each of them receives both senders' halves
    assert shard_pieces(6, 2, 4) == [
        piece for j in range(4) for piece in (Piece(0, j, 0, 3), Piece(1, j, 3, 6))
    ]


def test_under_sequence_parallelism_the_plan_of_transfers_keeps_each_ranks_tokens() -> None:
    plan = parse_plan({**PLAN, "sequence_parallel": True})
    topology = build_topology(plan, CLUSTER)
    vendors = topology.vendors(CLUSTER)
    spec = load_model("tiny-llama")
    shard = 2 * (64 // 2) * 64 * plan.precision.element_bytes  # (B, T/2, h): a TP rank's tokens
    for rank in range(topology.world_size):
        me = topology.ranks[rank]
        sends = [
            t
            for t in rank_transfers(plan, topology, spec, vendors, rank, grad_norm=False)
            if t.phase is Phase.FORWARD
        ]
        kinds = sorted(t.kind for t in sends)
        if me.stage == 1:  # each TP-2 receiver takes its own tokens, and gathers nothing
            assert kinds == [Kind.RECV] and sends[0].nbytes == shard, (rank, sends)
        elif me.replica == 0:  # TP 2 -> TP 2: rank i's shard to rank i, whole
            peer = topology.stage_ranks(0, 1)[me.tp_rank]
            assert [(t.kind, t.ranks, t.nbytes) for t in sends] == [
                (Kind.SEND, (rank, peer), shard)
            ]
        else:  # TP 1 holds every token: each receiver its half
            assert [(t.kind, t.nbytes) for t in sends] == [(Kind.SEND, shard)] * 2


def _exchange(rank: int, world: int) -> dict:
    """Stage 0 sends a known activation, stage 1 a known gradient back; what each rank
    received matched the whole tensor, and the bytes it counted per path."""
    plan = parse_plan(PLAN)
    topology = build_topology(plan, CLUSTER)
    vendors = topology.vendors(CLUSTER)
    spec = load_model("tiny-llama")
    created = create_groups(job_groups(topology, spec, vendors, ["gloo"] * world))
    groups = rank_groups(topology, spec, vendors, rank, created=created)
    comm = Communicator(vendors)
    links = StageLinks(comm, groups, torch.device("cpu"), torch.float32)
    me = topology.ranks[rank]
    activation = torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).view(SHAPE)
    gradient = -activation
    if me.stage == 0:
        links.wait(links.send(activation, forward=True))
        sent = dict(comm.bytes)
        got = links.receive(SHAPE, forward=False)
        return {"stage": 0, "sent": sent, "whole": torch.equal(got, gradient)}
    got = links.receive(SHAPE, forward=True)
    received = dict(comm.bytes)
    links.wait(links.send(gradient, forward=False))
    return {"stage": 1, "received": received, "whole": torch.equal(got, activation)}


@pytest.mark.slow
def test_each_tp_rank_sends_its_share_and_the_receivers_gather_the_whole() -> None:
    results = run_ranks(_exchange, 7, purpose="shard sends")
    assert all(r["whole"] for r in results)
    activation = torch.Size(SHAPE).numel() * 4  # fp32 bytes
    topology = build_topology(parse_plan(PLAN), CLUSTER)
    for rank, result in enumerate(results):
        me = topology.ranks[rank]
        if result["stage"] == 0:
            # TP 2 -> TP 2: activation / 2 each, across the bridge; TP 1 -> TP 2: the whole
            share = activation // (2 if me.replica == 0 else 1)
            assert result["sent"] == {NATIVE: 0, BRIDGE: share}
        else:
            # its half received, the other half all-gathered natively inside its TP group
            assert result["received"] == {NATIVE: activation // 2, BRIDGE: activation // 2}


BOUNDARY = Boundary(
    cluster=CLUSTER,
    model=load_model("tiny-llama"),
    micro_batch=2,
    precision=Precision.FP32,
    sender=CLUSTER.groups[0],
    receiver=CLUSTER.groups[0],
    tp_sender=2,
    tp_receiver=2,
    across_nodes=False,
)


def test_the_analytic_pricing_prices_half_the_message_and_the_receivers_gather() -> None:
    pricing = AnalyticPricing(default_calibration())
    whole = pricing.send(BOUNDARY._replace(tp_sender=1, tp_receiver=1))
    halves = pricing.send(BOUNDARY)
    numel = 2 * 64 * 64  # (B, T, h)
    assert shard_degrees(numel, 2, 2) == (2, 2)
    # half the bytes per rank, and an all-gather the TP-1 boundary does not have
    assert halves.forward_s != whole.forward_s
    one_to_two = pricing.send(BOUNDARY._replace(tp_sender=1))
    assert one_to_two.forward_s > halves.forward_s  # the single sender moves it all
    # a message no stage can cut (8192 elements among 3) goes whole
    assert shard_degrees(numel, 3, 3) == (1, 1)
    assert pricing.send(BOUNDARY._replace(tp_sender=3, tp_receiver=3)) == whole


def test_under_sequence_parallelism_each_rank_sends_its_tokens_and_nothing_is_gathered() -> None:
    pricing = AnalyticPricing(default_calibration())
    flat = pricing.send(BOUNDARY)
    kept = pricing.send(BOUNDARY._replace(sequence_parallel=True))
    cut = message_cut(2, BOUNDARY.model, sequence_parallel=True)
    assert (cut.positions, cut.numel, cut.gathered) == (64, 2 * 64 * 64, False)
    # the same half of the message from each rank, without the receiving stage's all-gather
    assert kept.forward_s < flat.forward_s and kept.backward_s < flat.backward_s
    assert kept.forward_s == kept.backward_s
    link = link_profile()
    measured = send_times(link, cut, 4, tp_sender=2, tp_receiver=2)
    assert measured.forward_s == pytest.approx(link.p2p_time(cut.numel * 4 / 2))
    # a stage of TP 1 holds every token: it sends them all, re-cut for the two receivers
    assert send_times(link, cut, 4, tp_sender=1, tp_receiver=2).forward_s == pytest.approx(
        link.p2p_time(cut.numel * 4)
    )


def test_the_profiled_pricing_prices_the_shards_then_the_all_gather() -> None:
    link = link_profile()  # all-gathers measured over 2 ranks only
    numel, element = 250_000, 4
    nbytes = numel * element
    cut = MessageCut(numel, 1, gathered=True)
    sent = send_times(link, cut, element, tp_sender=2, tp_receiver=2)
    expected = link.p2p_time(nbytes / 2) + link.allgather_time(nbytes, 2)
    assert sent.forward_s == pytest.approx(expected)
    assert sent.backward_s == pytest.approx(expected)
    recut = send_times(link, cut, element, tp_sender=1, tp_receiver=2)
    assert recut.forward_s == pytest.approx(link.p2p_time(nbytes) + link.allgather_time(nbytes, 2))
    assert recut.backward_s == pytest.approx(link.p2p_time(nbytes))  # a TP-1 sender gathers none
    assert (
        send_times(link, cut, element, tp_sender=4, tp_receiver=4) is None
    )  # an all-gather over 4 not measured
