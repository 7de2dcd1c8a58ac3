"""runtime.model's CPU RMSNorm and SwiGLU autograd Functions compute what torch's own operations
compute, forward and backward, while keeping less for backward (tests/test_layer_ops.py counts
what they keep): the norm against F.rms_norm, SwiGLU against F.silu(gate) * up."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from hethub.runtime.model import NORM_EPS, RMSNorm, _SwiGlu


def _grads(out: torch.Tensor, inputs: tuple[torch.Tensor, ...], seed: int = 1):
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    return torch.autograd.grad(out, inputs, grad_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_rms_norm_is_torch_s_forward_and_backward(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(96, eps=NORM_EPS).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.5)
    x = (3 * torch.randn(2, 16, 96)).to(dtype).requires_grad_()
    ours = norm(x)
    theirs = F.rms_norm(x, (96,), norm.weight, NORM_EPS)
    # the same operations in the same order, forward: bit for bit in bf16 and fp32 alike
    assert torch.equal(ours, theirs)
    grads = _grads(ours, (x, norm.weight))
    expected = _grads(theirs, (x, norm.weight))
    for got, want in zip(grads, expected, strict=True):
        assert got.dtype == want.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        else:  # fp32 sums in another order, one bf16 rounding apart at most
            ulp = want.abs().float() * 2**-8 + 1e-30
            assert ((got.float() - want.float()).abs() <= ulp).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_is_silu_of_the_gate_times_up_and_its_gradient_bit_for_bit(dtype):
    torch.manual_seed(0)
    gate_up = (2 * torch.randn(3, 8, 2 * 40)).to(dtype).requires_grad_()
    gate, up = gate_up.chunk(2, dim=-1)
    ours, theirs = _SwiGlu.apply(gate_up), F.silu(gate) * up
    assert torch.equal(ours, theirs)
    assert torch.equal(_grads(ours, (gate_up,))[0], _grads(theirs, (gate_up,))[0])
