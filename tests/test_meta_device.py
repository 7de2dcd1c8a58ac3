"""Every kind of stage runs forward and backward with its parameters and inputs on PyTorch's meta
device (shapes only, no data). Any tensor a forward or backward makes on the CPU instead of on
its input's device meets a meta tensor and fails here, as it would on any accelerator."""

from __future__ import annotations

import math

import pytest
import torch

from hethub.runtime.model import Stage
from hethub.spec import load_model
from hethub.spec.parameters import parameter_count, parameter_table, stage_parameters

META = torch.device("meta")
# (first layer, layers, is_first, is_last) of a 4-layer model: alone, first, middle, last
STAGES = [(0, 4, True, True), (0, 2, True, False), (2, 1, False, False), (3, 1, False, True)]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt"])
@pytest.mark.parametrize("first, count, is_first, is_last", STAGES)
@pytest.mark.parametrize("recompute", [False, True])
def test_a_stage_runs_forward_and_backward_on_the_meta_device(
    preset, first, count, is_first, is_last, recompute
):
    spec = load_model(preset)
    with torch.device(META):
        stage = Stage(spec, first, count, None, is_first=is_first, is_last=is_last)
    assert all(p.device == META for p in stage.parameters())
    b, t = 2, spec.seq_len
    if is_first:
        x = torch.empty(b, t, dtype=torch.long, device=META)
    else:
        x = torch.empty(b, t, spec.hidden, device=META, requires_grad=True)
    if recompute:
        out = torch.utils.checkpoint.checkpoint(stage, x, use_reentrant=False)
    else:
        out = stage(x)
    assert out.device == META
    if is_last:
        assert out.shape == (b, t, spec.vocab)
        targets = torch.empty(b, t, dtype=torch.long, device=META)
        stage.loss(out, targets).backward()
    else:
        assert out.shape == (b, t, spec.hidden)
        out.backward(torch.empty_like(out))
    for name, param in stage.named_parameters():
        assert param.grad is not None and param.grad.device == META, name
    if not is_first:
        assert x.grad is not None and x.grad.device == META


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt"])
@pytest.mark.parametrize("first, count, is_first, is_last", STAGES)
def test_a_stage_holds_exactly_the_table_s_parameters_at_their_shapes(
    preset, first, count, is_first, is_last
):
    spec = load_model(preset)
    with torch.device(META):
        stage = Stage(spec, first, count, None, is_first=is_first, is_last=is_last)
    table = parameter_table(spec)
    held = dict(stage.full_parameters())
    assert sorted(held) == sorted(
        stage_parameters(spec, first, count, is_first=is_first, is_last=is_last)
    )
    for name, param in held.items():
        assert tuple(param.shape) == table[name].shape, name
    # the table counts what the predictor counts
    assert sum(math.prod(p.shape) for p in table.values()) == parameter_count(spec)
