"""Tensor-parallel stages against the single-process reference: same loss, same gradients."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hethub.runtime.model import Stage, shard
from hethub.runtime.spawn import run_ranks
from hethub.spec import load_model
from hethub.spec.parameters import parameter_table


def _batch(spec, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec.vocab, (3, spec.seq_len + 1), generator=gen)


def _loss_and_grads(spec, group):
    model = Stage.build(spec, 0, spec.layers, group, is_first=True, is_last=True, seed=7)
    tokens = _batch(spec)
    loss = model.loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    return loss.item(), {model.full_name(n): p.grad for n, p in model.named_parameters()}


def _tp_rank(rank, world, preset):
    return _loss_and_grads(load_model(preset), dist.new_group(list(range(world))))


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt"])
def test_tp2_matches_the_single_process_reference(preset):
    spec = load_model(preset)
    ref_loss, ref_grads = _loss_and_grads(spec, None)
    results = run_ranks(_tp_rank, 2, preset)
    table = parameter_table(spec)
    for rank, (loss, grads) in enumerate(results):
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        assert set(grads) == set(ref_grads)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, shard(table[name], ref_grads[name], rank, 2), msg=name)
