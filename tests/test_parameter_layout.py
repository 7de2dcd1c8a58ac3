"""The parameter table (spec.parameters) is what the runtime builds and what the predictor counts:
real stages, on one rank and on a 2-rank TP group, hold exactly the table's names in its shard
shapes, and their full sizes add up to the predictor's parameter count of the stage. The fused
projections are q, k and v (gate and up) in blocks: a TP rank's contiguous slice of them is whole
heads of each (the same ffn features of each), and they count as the separate ones did."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from hethub.predictor.memory import stage_params
from hethub.predictor.stage import StagePosition
from hethub.runtime.model import Stage, full_state, fuse, shard, unfuse
from hethub.runtime.spawn import run_ranks
from hethub.spec import load_model
from hethub.spec.parameters import (
    fused_parts,
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


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("tp", [1, 2])
def test_a_tp_rank_s_slice_of_a_fused_projection_is_whole_heads_and_ffn_features(preset, tp):
    spec = load_model(preset)
    table, state = parameter_table(spec), full_state(spec, seed=3)
    queries = spec.heads // spec.kv_heads
    for name, parts in fused_parts(spec).items():
        full = state[f"layers.1.{name}"]
        q_or_gate, *others = unfuse(parts, full)
        for rank in range(tp):
            held = shard(table[f"layers.1.{name}"], full, rank, tp)
            if name.startswith("qkv"):  # (kv/tp, queries + 2, d, ...): this rank's KV heads
                mine = [held[:, :queries].flatten(0, 2), held[:, -2].flatten(0, 1)]
                mine.append(held[:, -1].flatten(0, 1))
            else:  # (2, f/tp, h): this rank's ffn features of gate, then of up
                mine = list(held)
            # the rank's heads of q (features of gate) are the same slice as of k and v (up),
            # the one the row-parallel o (down) holds the inputs of
            for got, part in zip(mine, [q_or_gate, *others], strict=True):
                assert torch.equal(got, part.chunk(tp)[rank]), (name, rank)


@pytest.mark.parametrize("preset", PRESETS)
def test_the_fused_blocks_pair_each_kv_head_with_its_queries_and_unfuse_inverts_fuse(preset):
    spec = load_model(preset)
    d, queries = spec.head_dim, spec.heads // spec.kv_heads
    for name, parts in fused_parts(spec).items():
        pieces = [torch.randn(shape) for shape in parts.shapes]
        fused = fuse(parts, pieces)
        assert fused.shape == parameter_table(spec)[f"layers.0.{name}"].shape
        assert all(torch.equal(a, b) for a, b in zip(unfuse(parts, fused), pieces, strict=True))
        if name.startswith("qkv"):  # query head i attends with KV head i // queries
            q, k, v = (piece.unflatten(0, (-1, d)) for piece in pieces)
            for head in range(spec.heads):
                group = head // queries
                assert torch.equal(fused[group, head % queries], q[head])
                assert torch.equal(fused[group, -2], k[group])
                assert torch.equal(fused[group, -1], v[group])
        else:
            assert torch.equal(fused.flatten(0, 1), torch.cat(pieces))  # [gate; up]


def test_the_fused_parameters_count_as_their_parts() -> None:
    for preset in (*PRESETS, "llama-140b", "gpt-1.3b"):
        spec = load_model(preset)
        table = parameter_table(spec)
        for name, parts in fused_parts(spec).items():
            whole = math.prod(table[f"layers.0.{name}"].shape)
            assert whole == sum(math.prod(shape) for shape in parts.shapes), (preset, name)
