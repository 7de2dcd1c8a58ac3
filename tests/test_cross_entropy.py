"""The runtime's cross-entropy (runtime.tensor_parallel) against float64's, unsharded and over
two vocabulary-parallel ranks, in fp32 and bf16; and what it keeps for its backward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from hethub.runtime.spawn import run_ranks
from hethub.runtime.tensor_parallel import vocab_parallel_cross_entropy

N, VOCAB = 96, 256


def logits_and_targets(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (N, VOCAB) of a trained model's spread (a few nats), in ``dtype``, and targets."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(N, VOCAB, generator=gen) * 3).to(dtype)
    return logits, torch.randint(0, VOCAB, (N,), generator=gen)


def exact(logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, torch.Tensor]:
    """float64's loss and logit gradient of ``logits`` (their values, whatever their dtype)."""
    x = logits.double().requires_grad_()
    loss = F.cross_entropy(x, targets)
    loss.backward()
    return loss.item(), x.grad


def loss_and_grad(logits, targets, start=0, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.detach().requires_grad_()
    loss = vocab_parallel_cross_entropy(x, targets, start, group)
    loss.backward()
    return loss, x.grad


def assert_close_to_exact(loss, grad, exact_loss, exact_grad, dtype) -> None:
    """fp32: the loss and gradient to fp32's rounding. bf16: the loss still to fp32's (it is
    computed in fp32), the gradient within bf16's rounding of the exact one (the distance of the
    exact gradient rounded to bf16, and a hair)."""
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(exact_loss, rel=1e-6)
    assert grad.dtype == dtype
    error = (grad.double() - exact_grad).norm().item()
    if dtype == torch.float32:
        assert error <= 1e-6 * exact_grad.norm().item()
    else:
        rounding = (exact_grad.to(dtype).double() - exact_grad).norm().item()
        assert error <= 1.1 * rounding, (error, rounding)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_unsharded_loss_is_exact_to_fp32_and_its_gradient_to_the_logits_dtype(dtype):
    logits, targets = logits_and_targets(dtype)
    loss, grad = loss_and_grad(logits, targets)
    assert_close_to_exact(loss, grad, *exact(logits, targets), dtype)


def test_bf16_logits_keep_nothing_in_fp32_the_size_of_the_logits_for_the_backward():
    # The logits themselves (bf16) and per-row facts (N each): no (N, VOCAB) fp32 softmax.
    logits, targets = logits_and_targets(torch.bfloat16)
    x = logits.requires_grad_()
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        vocab_parallel_cross_entropy(x, targets, 0, None)
    per_row = 4 + 8  # log-sum-exp (fp32), target index (int64)
    assert sum(kept.values()) == x.nbytes + N * per_row


def _two_ranks(rank: int, world: int) -> dict:
    """Each rank's loss and gradient of its half of the vocabulary, in fp32 and bf16."""
    group = dist.new_group(list(range(world)))
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        logits, targets = logits_and_targets(dtype)
        half = VOCAB // world
        mine = logits[:, rank * half : (rank + 1) * half]
        out[dtype] = loss_and_grad(mine, targets, rank * half, group)
    return out


@pytest.mark.slow
def test_two_vocabulary_parallel_ranks_give_the_exact_loss_and_their_slices_of_its_gradient():
    results = run_ranks(_two_ranks, 2)
    for dtype in (torch.float32, torch.bfloat16):
        logits, targets = logits_and_targets(dtype)
        loss, grad = results[0][dtype][0], torch.cat([r[dtype][1] for r in results], dim=-1)
        assert results[1][dtype][0].item() == loss.item()  # every rank has the whole loss
        assert_close_to_exact(loss, grad, *exact(logits, targets), dtype)
