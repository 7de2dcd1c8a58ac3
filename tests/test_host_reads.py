"""The host reads the device once a step (issue 26): counted with a TorchDispatchMode
(profiler.op_counts.OpCounter) around one step's schedule, gradient sync and loss
report, on real ranks, so that the sends, receives and collectives run too. On the CPU a read
shows as a scalar read (item, bool, float) or a copy to the host; before this, a step read every
micro-batch's loss with .item() and then the reported loss: 5 reads on a last stage of 4
micro-batches."""

from __future__ import annotations

import math

import pytest
import torch

from hethub.profiler.op_counts import OpCounter
from hethub.runtime.engine import Engine
from hethub.runtime.spawn import run_ranks
from hethub.spec import load_model, parse_cluster, parse_plan
from hethub.spec.topology import build_topology

PRESET = "tiny-llama"
CLUSTER = parse_cluster(
    {"groups": [{"name": "nv", "accelerator": "a100-80gb", "nodes": 1, "devices_per_node": 2}]},
    "test",
)
THE_STEPS_READ = ["aten._to_copy.default"]
"""The one read of a step: the loss (and when asked the largest weight) copied to the host."""


def plan_of(layers: list[int], precision: str) -> dict:
    """A 1F1B plan of 4 micro-batches over one stage a rank."""
    return {
        "model": PRESET,
        "precision": precision,
        "global_batch": 4,
        "pipelines": [
            {
                "count": 1,
                "micro_batches": 4,
                "stages": [{"group": "nv", "tp": 1, "layers": n} for n in layers],
            }
        ],
    }


def _count_reads(rank, world, plan_dict):
    spec, plan = load_model(PRESET), parse_plan(plan_dict)
    engine = Engine.for_job(plan, build_topology(plan, CLUSTER), spec, CLUSTER, seed=0)
    tokens = torch.randint(0, spec.vocab, (plan.global_batch, spec.seq_len + 1))
    engine.step(tokens)  # the first step makes the optimizer's state
    with OpCounter(engine.device) as schedule:
        loss = engine.gradients(tokens)
    with OpCounter(engine.device) as update:  # the optimizer's own, whatever they are
        engine.update()
    with OpCounter(engine.device) as checked:
        engine.step(tokens, check_weights=True)
    finite = engine.weights_finite
    name, weight = engine.weights.named[0]
    engine.weights.write(name, torch.full_like(weight, math.nan))
    engine.step(tokens, check_weights=True)
    return {
        "schedule": schedule.host_reads,
        "loss": loss,
        "checked_step": len(checked.host_reads) - len(update.host_reads),
        "finite": finite,
        "poisoned": (engine.weights_finite, engine.weights_are_finite()),
    }


@pytest.mark.slow
@pytest.mark.parametrize(("layers", "precision"), [([8], "bf16"), ([8], "fp32"), ([5, 3], "bf16")])
def test_a_step_reads_the_device_once(layers, precision):
    results = run_ranks(_count_reads, len(layers), plan_of(layers, precision), timeout_s=120)
    for result in results:
        assert result["schedule"] == THE_STEPS_READ
        assert math.isfinite(result["loss"])
        # checking the weights is read with the loss: no read of its own
        assert result["checked_step"] == len(THE_STEPS_READ)
        assert result["finite"] is True
        assert result["poisoned"] == (False, False)


def test_the_counter_sees_a_scalar_read_and_a_copy_to_the_host_not_a_cast():
    x = torch.ones(3)
    with OpCounter() as ops:
        x.sum().item()
        bool(x[0] > 0)
        x.to("cpu", copy=True)
        x.to(torch.bfloat16)
        x.double() + 1
    assert ops.host_reads == [
        "aten._local_scalar_dense.default",
        "aten._local_scalar_dense.default",
        "aten._to_copy.default",
    ]
    assert ops.total == 8  # sum, item; gt, item; the copy; two casts; the add (select: a view)
