"""The zero-bubble schedules run by the runtime (ZB-H1, and ZBV's V of two chunks a stage), each
backward split into its input's gradient (B) and its weights' (W, runtime.split_backward):
against the single-process reference (tests/test_engine.py's check: fp32 first-step gradients
with assert_close and the losses within 1e-5; bf16 within its rounding, gradients compared),
over non-uniform chunks, TP 2 on one stage across vendors, a zero-bubble replica beside a 1F1B
one, an overlapped sharded sync, full recomputation on one stage; and a run resumed under
ZB-H1 from a 1F1B checkpoint. Also, without processes: B then W gives each weight the gradient
one backward gives, bit for bit, with the hooks a backward runs; and the V's pair groups."""

from __future__ import annotations

import pytest
import torch
from test_checkpoint import job, step_dir, train
from test_checkpoint import plan_dict as checkpoint_plan
from test_engine import CLUSTER, PLANS, check_against_reference, stage

from hethub.errors import SpecError
from hethub.runtime.model import Stage
from hethub.runtime.process_groups import Role, job_groups, rank_groups
from hethub.runtime.split_backward import input_backward
from hethub.spec import check_plan, load_model, parse_plan
from hethub.spec.buckets import BUCKET_BYTES
from hethub.spec.plan import Recompute
from hethub.spec.schedules import BACKWARD, FORWARD, Schedule, chunk_sequence
from hethub.spec.topology import build_topology, layout_classes


def own_stage(group, tp, layers, recompute):
    return {**stage(group, tp, layers), "recompute": recompute}


ZERO_BUBBLE_PLANS = {
    "zb-h1 over pp 3, unlike layer counts, across vendors": (
        "tiny-llama",
        {
            "global_batch": 4,
            "schedule": "zb-h1",
            "pipelines": [
                {
                    "count": 1,
                    "micro_batches": 4,
                    "stages": [stage("nv", 1, 3), stage("amd", 1, 1), stage("nv", 1, 4)],
                }
            ],
        },
    ),
    "zb-h1, tp 2 on one stage across vendors, tied embedding": (
        "tiny-gpt",
        {
            "global_batch": 3,
            "schedule": "zb-h1",
            "pipelines": [
                {"count": 1, "micro_batches": 3, "stages": [stage("nv", 2, 5), stage("amd", 1, 3)]}
            ],
        },
    ),
    "zbv over pp 2, non-uniform chunks": (
        "tiny-llama",
        {
            "global_batch": 5,
            "schedule": "zbv",
            "pipelines": [
                {
                    "count": 1,
                    "micro_batches": 5,
                    "stages": [stage("nv", 1, [3, 1]), stage("amd", 1, [2, 2])],
                }
            ],
        },
    ),
    "zbv over pp 3, tp 2 on one stage across vendors": (
        "tiny-llama",
        {
            "global_batch": 4,
            "schedule": "zbv",
            "pipelines": [
                {
                    "count": 1,
                    "micro_batches": 4,
                    "stages": [
                        stage("nv", 1, [1, 2]),
                        stage("amd", 2, [1, 1]),
                        stage("nv", 1, [2, 1]),
                    ],
                }
            ],
        },
    ),
    "a zbv replica beside a 1f1b replica": (
        "tiny-llama",
        {
            "global_batch": 5,
            "schedule": "zbv",
            "pipelines": [
                {
                    "count": 1,
                    "micro_batches": 3,
                    "stages": [stage("nv", 1, [1, 2]), stage("amd", 1, [3, 2])],
                },
                {
                    "count": 1,
                    "micro_batches": 2,
                    "schedule": "1f1b",
                    "stages": [stage("amd", 1, 3), stage("nv", 1, 5)],
                },
            ],
        },
    ),
    "zb-h1 replicas, sharded and overlapped sync, full recompute on one stage": (
        "tiny-llama",
        {
            "global_batch": 4,
            "schedule": "zb-h1",
            "shard_optimizer": True,
            "overlap_grad_sync": True,
            "pipelines": [
                {
                    "count": 2,
                    "micro_batches": 2,
                    "stages": [own_stage("nv", 1, 5, "full"), stage("amd", 1, 3)],
                }
            ],
        },
    ),
}

BF16_PLANS = [
    "zb-h1, tp 2 on one stage across vendors, tied embedding",
    "zbv over pp 3, tp 2 on one stage across vendors",
]


@pytest.mark.parametrize("name", ZERO_BUBBLE_PLANS)
def test_a_zero_bubble_plan_matches_the_single_process_reference(name, monkeypatch):
    monkeypatch.setitem(PLANS, name, ZERO_BUBBLE_PLANS[name])
    check_against_reference(name, BUCKET_BYTES)


def test_overlapped_zero_bubble_replicas_match_the_reference_in_many_small_buckets(monkeypatch):
    # W gives the weights' gradients, and so the overlapped sync's hooks, in one order on every
    # peer: with buckets of a tensor or two, the peers' sums start in that order.
    name = "zb-h1 replicas, sharded and overlapped sync, full recompute on one stage"
    monkeypatch.setitem(PLANS, name, ZERO_BUBBLE_PLANS[name])
    check_against_reference(name, 4096)


def test_a_zero_bubble_layout_and_a_1f1b_one_of_the_same_stages_are_not_peers():
    # Their backwards give the gradients in different orders, which an overlapped sync between
    # peers cannot take: they sum through the stage leaders instead.
    stages = [stage("nv", 1, 5), stage("amd", 1, 3)]
    layouts = [
        {"count": 2, "micro_batches": 1, "schedule": schedule, "stages": stages}
        for schedule in ("zb-h1", "1f1b")
    ]
    plan = parse_plan(
        {"model": "tiny-llama", "micro_batch": 1, "global_batch": 4, "pipelines": layouts}
    )
    assert layout_classes(plan) == (0, 1)
    topology = build_topology(plan, CLUSTER)
    assert {len(topology.data_parallel_peers(r.rank)) for r in topology.ranks} == {2}


@pytest.mark.parametrize("name", BF16_PLANS)
def test_a_zero_bubble_plan_in_bf16_matches_the_bf16_reference(name, monkeypatch):
    monkeypatch.setitem(PLANS, name, ZERO_BUBBLE_PLANS[name])
    check_against_reference(name, BUCKET_BYTES, "bf16")


RESUME_STAGES = [stage("nv", 1, 3), stage("amd", 1, 5)]


def test_a_1f1b_checkpoint_resumes_under_zb_h1_as_the_uninterrupted_run(tmp_path):
    one_f_one_b = checkpoint_plan(
        "tiny-llama", 4, [{"count": 1, "micro_batches": 4, "stages": RESUME_STAGES}]
    )
    zero_bubble = {**one_f_one_b, "schedule": "zb-h1"}
    saved = str(tmp_path / "1f1b")
    uninterrupted, resumed = job(
        tmp_path,
        [
            ("1f1b", one_f_one_b, train(0, 1) + [("save", saved, 2)] + train(2, 3)),
            ("zb-h1", zero_bubble, [("load", str(step_dir(saved, 2)))] + train(2, 3)),
        ],
    )
    for rank in resumed:
        torch.testing.assert_close(
            rank["losses"], uninterrupted[0]["losses"][2:], rtol=1e-5, atol=0
        )


@pytest.mark.parametrize("recompute", [Recompute.NONE, Recompute.FULL])
@pytest.mark.parametrize(("is_first", "is_last"), [(False, False), (False, True), (True, False)])
def test_b_then_w_gives_each_weight_what_one_backward_gives(is_first, is_last, recompute):
    # Bit for bit, over two micro-batches (the second accumulates), on a middle chunk, the one
    # with the loss and the one with the embedding; B gives no weight a gradient; a hook's
    # callback queued at a weight's accumulation (runtime.precision's move into the main
    # gradients) runs once per W, after every weight has its gradient.
    spec = load_model("tiny-llama")
    torch.manual_seed(0)
    tokens = torch.randint(0, spec.vocab, (2, spec.seq_len + 1))
    given = torch.randn(2, spec.seq_len, spec.hidden)
    grad_out = None if is_last else torch.randn(2, spec.seq_len, spec.hidden)

    def run(model: Stage, split: bool) -> torch.Tensor | None:
        x = tokens[:, :-1] if is_first else given.clone().requires_grad_()
        out = model(x, recompute=recompute)
        if is_last:
            out = model.loss(out, tokens[:, 1:])
        if not split:
            out.backward(grad_out)
        else:
            before = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
            weight_pass = input_backward(out, grad_out, None if is_first else x, weights)
            after_b = [p.grad for p in model.parameters()]
            assert all(
                (a is None and b is None) or torch.equal(a, b)
                for a, b in zip(after_b, before, strict=True)
            )
            weight_pass.run()
        return None if is_first else x.grad

    def build() -> Stage:
        return Stage.build(spec, 2, 2, None, is_first=is_first, is_last=is_last, seed=3)

    whole, split = build(), build()
    weights = list(split.parameters())
    given_at_flush = []

    def flush_hook(_: torch.Tensor) -> None:
        def count() -> None:
            given_at_flush.append(sum(p.grad is not None for p in weights))

        torch.autograd.Variable._execution_engine.queue_callback(count)

    weights[0].register_post_accumulate_grad_hook(flush_hook)
    for _ in range(2):
        torch.testing.assert_close(run(split, True), run(whole, False), rtol=0, atol=0)
    for (name, a), b in zip(whole.named_parameters(), weights, strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name)
    assert given_at_flush == [len(weights)] * 2


def test_a_v_pairs_each_neighbour_both_ways_and_never_wraps_around():
    # ZBV over 3 stages: chunk 0 flows 0 -> 1 -> 2, turns on stage 2, chunk 1 flows 2 -> 1 -> 0.
    _, fields = ZERO_BUBBLE_PLANS["zbv over pp 3, tp 2 on one stage across vendors"]
    plan = parse_plan({"model": "tiny-llama", "micro_batch": 1, **fields})
    spec = load_model("tiny-llama")
    check_plan(plan, CLUSTER, spec)
    topology = build_topology(plan, CLUSTER)
    stages = [topology.stage_ranks(0, s) for s in range(3)]
    vendors = topology.vendors(CLUSTER)
    pairs = {
        g.ranks
        for g in job_groups(topology, spec, vendors, ["gloo"] * 4)
        if g.role is Role.PIPELINE
    }
    a, b, c = stages  # each stage's TP ranks: a pair group holds both stages'
    assert pairs == {a + b, b + a, b + c, c + b}
    first, middle, last = (rank_groups(topology, spec, vendors, s[0]) for s in stages)
    assert (first.pipeline_prev, first.pipeline_return_next) == (None, None)
    assert (last.pipeline_next, last.pipeline_return_prev) == (None, None)
    assert middle.pipeline_prev.ranks == a + b and middle.pipeline_next.ranks == b + c
    assert middle.pipeline_return_prev.ranks == c + b
    assert middle.pipeline_return_next.ranks == b + a


@pytest.mark.parametrize("schedule", [Schedule.ZB_H1, Schedule.ZBV])
@pytest.mark.parametrize(("stages", "micro_batches"), [(2, 2), (3, 4), (4, 7)])
def test_both_ends_of_each_pair_run_its_messages_in_the_same_order(schedule, stages, micro_batches):
    # Pair groups carry untagged messages, matched in order: a stage's forwards (backwards) of a
    # chunk, which send (receive), run its micro-batches in the order its neighbour's do.
    chunks = 2 if schedule == Schedule.ZBV else 1
    orders = [chunk_sequence(schedule, s, stages, chunks, micro_batches) for s in range(stages)]

    def micro_batches_of(s: int, kind: int, chunk: int) -> list[int]:
        return [j for k, c, j in orders[s] if (k, c) == (kind, chunk)]

    for s in range(stages - 1):
        for kind in (FORWARD, BACKWARD):
            for chunk in range(chunks):
                assert micro_batches_of(s, kind, chunk) == micro_batches_of(s + 1, kind, chunk)


def test_zbv_refuses_a_model_whose_head_is_tied_to_its_embedding():
    # The V's first stage would hold GPT's embedding and its tied head together.
    raw = {
        "model": "tiny-gpt",
        "global_batch": 2,
        "schedule": "zbv",
        "pipelines": [{"count": 1, "stages": [stage("nv", 1, [2, 2]), stage("amd", 1, [2, 2])]}],
    }
    with pytest.raises(SpecError, match=r"pipelines\[0\]\.schedule.*tied to its embedding"):
        check_plan(parse_plan(raw), CLUSTER, load_model("tiny-gpt"))
    llama = {**raw, "model": "tiny-llama"}
    check_plan(parse_plan(llama), CLUSTER, load_model("tiny-llama"))
