"""The Llama stage's rotary position embedding: its tables, made once a stage and shared by its
layers, and the rotation they make, checked against what a rotation is."""

from __future__ import annotations

import torch

from hethub.runtime.model import Rotary, Stage
from hethub.runtime.precision import MasterWeights
from hethub.spec import load_model

SPEC = load_model("tiny-llama")


def built_stage() -> Stage:
    """A middle stage of three layers, built as the runtime builds one (on the meta device, then
    allocated): its tables exist only if the build remade them."""
    return Stage.build(SPEC, 2, 3, None, is_first=False, is_last=False, seed=0)


def test_a_built_stage_s_layers_share_one_table_of_the_rotary_angles():
    stage = built_stage()
    (rotary,) = {id(layer.rotary): layer.rotary for layer in stage.layers.values()}.values()
    d, t = SPEC.head_dim, SPEC.seq_len
    angles = [[p * 10000 ** (-2 * (i % (d // 2)) / d) for i in range(d)] for p in range(t)]
    angles = torch.tensor(angles, dtype=torch.float64)
    sign = torch.cat([-torch.ones(d // 2), torch.ones(d // 2)]).double()
    torch.testing.assert_close(rotary.cos.double(), angles.cos(), rtol=0, atol=1e-5)
    torch.testing.assert_close(rotary.sin.double(), sign * angles.sin(), rtol=0, atol=1e-5)
    # not persistent: a checkpoint holds the parameters, as before the tables were buffers
    assert stage.state_dict().keys() == dict(stage.named_parameters()).keys()


def pair_lengths(x: torch.Tensor, half: int) -> torch.Tensor:
    return x[..., :half].square() + x[..., half:].square()


def test_the_rotation_turns_each_pair_by_its_position_s_angle():
    rotary = Rotary(SPEC.head_dim, SPEC.seq_len)
    d, half = SPEC.head_dim, SPEC.head_dim // 2
    q, k = torch.randn(2, 1, SPEC.seq_len, d, dtype=torch.float64).unbind(0)
    rotary.reset_tables(torch.float64)
    rq, rk = rotary(q), rotary(k)
    # a rotation of each pair (i, i + d/2): lengths kept ...
    torch.testing.assert_close(pair_lengths(rq, half), pair_lengths(q, half))
    # ... and scores that depend on positions only through their difference: q at m against k
    # at n scores as q at m + s against k at n + s when both are moved (to the fp32 angles'
    # rounding: scores of about 16 within 1e-4)
    scores = rq[0] @ rk[0].T  # (T, T)
    moved = rotary(q.roll(5, dims=-2))[0] @ rotary(k.roll(5, dims=-2))[0].T
    torch.testing.assert_close(moved[5:, 5:], scores[:-5, :-5], rtol=0, atol=1e-4)
    # ... and only position 0 is not turned
    torch.testing.assert_close(rq[..., 0, :], q[..., 0, :])
    assert not torch.allclose(rq[..., 1, :], q[..., 1, :])


def test_the_tables_follow_the_stage_into_bf16_rounded_once_from_fp32():
    stage = built_stage()
    fp32 = stage.layers["2"].rotary.cos.clone(), stage.layers["2"].rotary.sin.clone()
    weights = MasterWeights(stage, "bf16")
    stage(torch.randn(1, SPEC.seq_len, SPEC.hidden, dtype=weights.compute_dtype))
    rotary = stage.layers["2"].rotary
    assert torch.equal(rotary.cos, fp32[0].bfloat16())
    assert torch.equal(rotary.sin, fp32[1].bfloat16())
