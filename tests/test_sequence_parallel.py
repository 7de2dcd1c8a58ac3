"""Sequence parallelism (plan field ``sequence_parallel``) run by the runtime against the
single-process reference (tests/test_engine.py's check: fp32 first-step gradients with
assert_close and the losses within 1e-5; bf16 within its rounding tolerance; and every rank's
bytes, path by path, those of spec.collectives' plan of transfers), at TP 2 on one stage across
vendors (a stage of TP 1 beside it: its whole sequence re-cut into the shards, and back), at
TP 2 on both sides of a boundary (each rank's shard to its peer, nothing gathered), at unlike
degrees with two sequences a micro-batch (strided pieces), and at TP 4 with two sequences a
micro-batch (the embedding reduce-scattered, the final norm on the shard, GPT's position
embedding, row-parallel biases and tied head); and its plan rule."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import yaml
from test_engine import CLUSTER, PLANS, check_against_reference, stage
from test_layer_ops import GPT, LLAMA_GQA, SavedBytes, Trace, assert_same_ops

from hethub.errors import SpecError
from hethub.runtime.model import Layer
from hethub.runtime.spawn import run_ranks
from hethub.spec import check_plan, load_model, parse_plan
from hethub.spec.buckets import BUCKET_BYTES
from hethub.spec.layer_ops import layer_ops
from hethub.spec.model import ModelSpec
from hethub.spec.ops import Kernels, Op
from hethub.spec.plan import Precision

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
    "sp, tp 2 to tp 2 across vendors, two sequences a micro-batch": (
        "tiny-llama",
        {
            "global_batch": 4,
            "micro_batch": 2,
            "sequence_parallel": True,
            "pipelines": [
                {"count": 1, "micro_batches": 2, "stages": [stage("nv", 2, 4), stage("amd", 2, 4)]}
            ],
        },
    ),
    "sp, tp 2 to tp 1 to tp 2, two sequences a micro-batch": (
        "tiny-gpt",
        {
            "global_batch": 4,
            "micro_batch": 2,
            "sequence_parallel": True,
            "pipelines": [
                {
                    "count": 1,
                    "micro_batches": 2,
                    "stages": [stage("nv", 2, 3), stage("amd", 1, 2), stage("nv", 2, 3)],
                }
            ],
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


def traced_sequence_parallel_layer(
    model: ModelSpec, group, tp: int, precision: Precision, micro_batch: int
) -> tuple[list[Op], list[Op], int]:
    """tests/test_layer_ops.traced_layer for the sequence-parallel Layer: its input and output
    are this rank's (B, T/tp, h)."""
    torch.manual_seed(0)
    dtype = getattr(torch, precision.dtype_name)
    layer = Layer(model, group, sequence_parallel=True)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(std=0.02)
    layer.to(dtype)
    shape = (micro_batch, model.seq_len // tp, model.hidden)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    saved = SavedBytes([*layer.parameters(), *layer.buffers()])
    with Trace() as forward, torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        y = layer(x)
    assert y.shape == shape
    grad = torch.randn_like(y)
    with Trace() as backward:
        y.backward(grad)
    return forward.ops, backward.ops, saved.total


def _layer_ops_rank(rank: int, world: int) -> None:
    group = dist.new_group(list(range(world)))
    for model in (LLAMA_GQA, GPT):
        for precision in (Precision.FP32, Precision.BF16):
            for micro_batch in (1, 2):  # one sequence: no copy around the collectives
                forward, backward, saved = traced_sequence_parallel_layer(
                    model, group, world, precision, micro_batch
                )
                described = layer_ops(
                    model, world, micro_batch, precision, Kernels.CPU, sequence_parallel=True
                )
                what = f"{model.name} tp={world} {precision} micro-batch {micro_batch}"
                assert_same_ops(forward, described.forward, f"{what} forward")
                assert_same_ops(backward, described.backward, f"{what} backward")
                assert saved == described.saved_bytes, what


@pytest.mark.slow
def test_the_sequence_parallel_description_is_what_the_layer_dispatches_at_tp2():
    run_ranks(_layer_ops_rank, 2, purpose="sequence-parallel layer_ops at TP 2", timeout_s=120)


def test_sequence_parallel_is_a_plan_field_off_by_default_and_round_trips():
    fields = {
        "model": "tiny-gpt",
        "global_batch": 1,
        "pipelines": [{"stages": [stage("nv", 2, 8)]}],
    }
    plain = parse_plan(fields)
    assert plain.sequence_parallel is False and "sequence_parallel" not in plain.to_dict()
    split = parse_plan({**fields, "sequence_parallel": True})
    assert split.to_dict()["sequence_parallel"] is True
    assert parse_plan(yaml.safe_load(split.to_yaml())) == split
    assert "sequence parallel" in split.summary() and "sequence parallel" not in plain.summary()
    with pytest.raises(SpecError, match="sequence_parallel.*must be true or false"):
        parse_plan({**fields, "sequence_parallel": "yes"})
