"""Sequence parallelism (plan field ``sequence_parallel``) run by the runtime against the
single-process reference (tests/test_engine.py's check: fp32 first-step gradients with
assert_close and the losses within 1e-5; bf16 within its rounding tolerance), at TP 2 on one
stage across vendors (the shard split at a stage's input, and gathered at its output) and at
TP 4 with two sequences a micro-batch (the embedding reduce-scattered, the final norm on the
shard, GPT's position embedding, row-parallel biases and tied head); and its plan rule."""

from __future__ import annotations

import dataclasses

import pytest
from test_engine import CLUSTER, PLANS, check_against_reference, stage

from hethub.errors import SpecError
from hethub.spec import check_plan, load_model, parse_plan
from hethub.spec.buckets import BUCKET_BYTES

SP_PLANS = {
    "sp, tp 2 on the last stage across vendors": (
        "tiny-llama",
        {
            "global_batch": 3,
            "sequence_parallel": True,
            "pipelines": [
                {"count": 1, "micro_batches": 3, "stages": [stage("amd", 1, 3), stage("nv", 2, 5)]}
            ],
        },
    ),
    "sp, tp 2 on the first stage across vendors": (
        "tiny-gpt",
        {
            "global_batch": 3,
            "sequence_parallel": True,
            "pipelines": [
                {"count": 1, "micro_batches": 3, "stages": [stage("nv", 2, 4), stage("amd", 1, 4)]}
            ],
        },
    ),
    "sp, tp 4, two sequences a micro-batch": (
        "tiny-gpt",
        {
            "global_batch": 4,
            "micro_batch": 2,
            "sequence_parallel": True,
            "pipelines": [{"count": 1, "micro_batches": 2, "stages": [stage("nv", 4, 8)]}],
        },
    ),
}
PLANS.update(SP_PLANS)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SP_PLANS))
def test_sequence_parallel_matches_the_single_process_reference(name):
    check_against_reference(name, BUCKET_BYTES)


@pytest.mark.slow
def test_bf16_sequence_parallel_matches_the_single_process_bf16_reference():
    check_against_reference("sp, tp 2 on the last stage across vendors", BUCKET_BYTES, "bf16")


def test_sequence_parallel_needs_every_tp_to_divide_the_sequence():
    model = load_model("tiny-gpt")  # heads 4: tp 4 divides them, and seq_len 64, not 66
    odd = dataclasses.replace(model, seq_len=66)
    plan = parse_plan(
        {
            "model": "tiny-gpt",
            "global_batch": 1,
            "sequence_parallel": True,
            "pipelines": [{"count": 1, "stages": [stage("amd", 1, 4), stage("nv", 4, 4)]}],
        }
    )
    with pytest.raises(SpecError, match=r"stages\[1\]\.tp.*seq_len \(66\)"):
        check_plan(plan, CLUSTER, odd)
    check_plan(plan, CLUSTER, model)
    plain = parse_plan({**plan.to_dict(), "sequence_parallel": False})
    check_plan(plain, CLUSTER, odd)  # without sequence parallelism the sequence is not split
