"""A plan's ``compile: true``: the field, and compiled layouts against the single-process
reference (tests/test_engine.py's, at its tolerances), each rank's layers run by one compiled
graph."""

from __future__ import annotations

import pytest
import torch
import yaml
from test_engine import (
    BF16_LOSS_RTOL,
    CLUSTER,
    PLANS,
    assert_within_bf16_rounding,
    reference,
)
from test_engine import _rank as engine_rank

from hethub.errors import HethubError
from hethub.runtime.compiled import compile_layers, compiled_graphs, compiled_layers
from hethub.runtime.model import Stage, StageChunks, shard
from hethub.runtime.spawn import run_ranks
from hethub.spec import load_model, parse_plan
from hethub.spec.parameters import parameter_table
from hethub.spec.topology import build_topology

PLAN = {
    "model": "tiny-llama",
    "global_batch": 2,
    "pipelines": [{"stages": [{"group": "nv", "tp": 1, "layers": 8}]}],
}


def test_compile_is_a_plan_field_off_by_default_and_round_trips():
    plain = parse_plan(PLAN)
    assert plain.compile is False and "compile" not in plain.to_dict()
    assert "compiled" not in plain.summary()
    compiled = parse_plan({**PLAN, "compile": True})
    assert compiled.compile is True and compiled.to_dict()["compile"] is True
    assert parse_plan(yaml.safe_load(compiled.to_yaml())) == compiled
    assert compiled.summary().startswith("bf16, micro-batch 1, recompute none, compiled layers: ")


def test_a_compile_that_is_not_a_boolean_is_refused_as_the_other_switches_are():
    with pytest.raises(HethubError) as compile_error:
        parse_plan({**PLAN, "compile": "yes"}, "plan.yaml")
    with pytest.raises(HethubError) as shard_error:
        parse_plan({**PLAN, "shard_optimizer": "yes"}, "plan.yaml")
    message = str(compile_error.value)
    assert "compile" in message and "must be true or false" in message
    assert message.replace("compile", "shard_optimizer") == str(shard_error.value)


def _stage(spec) -> StageChunks:
    return StageChunks(
        [Stage.build(spec, 0, spec.layers, None, is_first=True, is_last=True, seed=1)]
    )


def test_compile_layers_compiles_each_layer_only_where_the_plan_says():
    spec = load_model("tiny-llama")
    eager, compiled = _stage(spec), _stage(spec)
    compile_layers(eager, parse_plan(PLAN))
    compile_layers(compiled, parse_plan({**PLAN, "compile": True, "precision": "bf16"}))
    assert compiled_layers(eager) == 0
    assert compiled_layers(compiled) == spec.layers
    # The rotary tables are made in the compute dtype before the first (compiled) call.
    rotary = compiled.chunks[0].layers["0"].rotary
    assert rotary.cos.dtype == rotary.sin.dtype == torch.bfloat16


def _compiled_rank(rank, world, preset, plan_dict):
    """test_engine's rank, and how many graphs dynamo compiled in this rank's process."""
    return engine_rank(rank, world, preset, plan_dict), compiled_graphs()


# One compiled layout per precision, between them GPT and Llama, TP 2 (the region functions'
# all-reduces inside the compiled graph), pipeline stages and recomputation: full on one stage
# (each compiled layer checkpointed), selective on the other (the checkpoint of the attention's
# inner part inside the compiled graph). Each rank's process compiles its graph, tens of seconds
# on 2 cores, so no more.
STAGE_RECOMPUTE = "recompute full then selective, gpipe"
COMPILED_PLANS = {
    **PLANS,
    STAGE_RECOMPUTE: (
        PLANS["recompute, gpipe"][0],
        {
            **PLANS["recompute, gpipe"][1],
            "pipelines": [
                {
                    "count": 1,
                    "micro_batches": 4,
                    "stages": [
                        {"group": "nv", "tp": 1, "layers": 2},
                        {"group": "amd", "tp": 1, "layers": 6, "recompute": "selective"},
                    ],
                }
            ],
        },
    ),
}
COMPILED = [("tp 2", "fp32"), (STAGE_RECOMPUTE, "bf16")]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "precision"), COMPILED)
def test_a_compiled_layout_matches_the_single_process_reference(name, precision):
    preset, fields = COMPILED_PLANS[name]
    plan_dict = {"model": preset, "micro_batch": 1, "precision": precision, **fields}
    plan_dict["compile"] = True
    plan = parse_plan(plan_dict)
    world = build_topology(plan, CLUSTER).world_size
    ref_losses, ref_grads = reference(preset, plan.global_batch, precision)
    results = run_ranks(_compiled_rank, world, preset, plan_dict, timeout_s=300)
    table = parameter_table(load_model(preset))
    fp32_grads = reference(preset, plan.global_batch, "fp32")[1]
    for (losses, grads, tp_rank, tp, computed_in, _), graphs in results:
        # Every rank's layers ran compiled, all of them by one graph: a stage of N layers
        # compiles once, not N times.
        assert graphs == 1
        for full_name, grad in grads.items():
            expected = shard(table[full_name], ref_grads[full_name], tp_rank, tp)
            if precision == "fp32":
                torch.testing.assert_close(grad, expected, msg=full_name)
            else:
                exact = shard(table[full_name], fp32_grads[full_name], tp_rank, tp)
                assert_within_bf16_rounding(grad, expected, exact, full_name)
        rtol = 1e-5 if precision == "fp32" else BF16_LOSS_RTOL
        assert losses == pytest.approx(ref_losses, rel=rtol)
        assert computed_in == {getattr(torch, plan.precision.dtype_name)}
