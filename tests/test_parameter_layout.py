"""The parameter table (spec.parameters) is what the runtime builds and what the predictor counts:
real stages, on one rank and on a 2-rank TP group, hold exactly the table's names in its shard
shapes, and their full sizes add up to the predictor's parameter count of the stage."""

from __future__ import annotations

import math

import pytest
import torch.distributed as dist

from hethub.predictor.memory import stage_params
from hethub.predictor.stage import StagePosition
from hethub.runtime.model import Stage
from hethub.runtime.spawn import run_ranks
from hethub.spec import load_model
from hethub.spec.parameters import (
    parameter_count,
    parameter_counts,
    parameter_table,
    stage_parameters,
)

PRESETS = ("tiny-gpt", "tiny-llama")  # tied embedding; grouped-query attention (4 heads, 2 kv)
# (first layer, layers, is_first, is_last) of an 8-layer model
STAGES = {
    "first": (0, 3, True, False),
    "middle": (3, 2, False, False),
    "last": (5, 3, False, True),
    "alone": (0, 8, True, True),
}


def _built(group) -> dict[tuple[str, str], list[tuple[str, tuple[int, ...]]]]:
    """(full-model name, shape) of every parameter of each stage of each preset, as built."""
    built = {}
    for preset in PRESETS:
        spec = load_model(preset)
        for where, (first, count, is_first, is_last) in STAGES.items():
            stage = Stage.build(
                spec, first, count, group, is_first=is_first, is_last=is_last, seed=0
            )
            built[preset, where] = [(n, tuple(p.shape)) for n, p in stage.full_parameters()]
    return built


def _tp_rank(rank: int, world: int):
    return _built(dist.new_group(list(range(world))))


def _check(built, tp: int) -> None:
    for (preset, where), params in built.items():
        spec = load_model(preset)
        first, count, is_first, is_last = STAGES[where]
        table = parameter_table(spec)
        names = stage_parameters(spec, first, count, is_first=is_first, is_last=is_last)
        assert [n for n, _ in params] == sorted(names), (preset, where)
        for name, shape in params:
            assert shape == table[name].shard_shape(tp), (preset, where, name)
            whole = math.prod(table[name].shape)
            assert math.prod(shape) == (whole if table[name].tp_dim is None else whole // tp)
        # the predictor counts every parameter the stage holds, its tied copy included
        position = StagePosition(first=is_first, last=is_last, alone=is_first and is_last)
        assert stage_params(spec, count, position) == sum(
            math.prod(table[name].shape) for name in names
        ), (preset, where)


def test_one_rank_holds_the_table_s_parameters_in_full() -> None:
    _check(_built(None), 1)


def test_each_of_two_tp_ranks_holds_the_table_s_shard_shapes() -> None:
    for built in run_ranks(_tp_rank, 2, purpose="test"):
        _check(built, 2)


@pytest.mark.parametrize("preset", ["tiny-gpt", "tiny-llama", "llama-140b", "gpt-1.3b"])
def test_the_counts_by_part_are_the_table_s(preset: str) -> None:
    spec = load_model(preset)
    table = parameter_table(spec)
    assert parameter_count(spec) == sum(math.prod(p.shape) for p in table.values())
    counts = parameter_counts(spec)
    for i in (0, spec.layers - 1):
        layer = [p for p in table.values() if p.layer == i]
        assert counts.layer == sum(math.prod(p.shape) for p in layer)
