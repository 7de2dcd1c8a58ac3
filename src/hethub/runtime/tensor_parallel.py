"""Megatron-style tensor parallelism: column/row-parallel linears, the vocabulary-parallel
embedding and cross-entropy, over a torch.distributed process group.

The two region functions are the whole communication of a TP layer: ``copy_to`` (identity
forward, all-reduce of the input gradient backward) opens a column-parallel region, and
``reduce_from`` (all-reduce forward, identity backward) closes a row-parallel one. A group of one
rank is no group (``parallel_group``): the modules then run as plain ones, a bare F.linear or
F.embedding with no region function.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F


def _all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.contiguous(), ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to(x: torch.Tensor, group) -> torch.Tensor:
    """``x``, whose gradient is all-reduced over ``group``; no group (None): ``x`` itself."""
    return x if group is None else _CopyToRegion.apply(x, group)


def reduce_from(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` all-reduced over ``group``, its gradient passed through; no group: ``x`` itself."""
    return x if group is None else _ReduceFromRegion.apply(x, group)


def tp_size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def tp_rank(group) -> int:
    return dist.get_rank(group) if group is not None else 0


def parallel_group(group):
    """``group`` if it spans more than one rank, else None. A one-rank group communicates
    nothing, and an autograd Function that does nothing still costs a Python call forward and
    backward for every linear of every micro-batch: the modules keep None instead."""
    return group if tp_size(group) > 1 else None


class ColumnParallelLinear(nn.Module):
    """y_shard = x W_shard^T (+ b_shard): each rank holds a slice of the output features."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group) -> None:
        super().__init__()
        self.group = parallel_group(group)
        size = tp_size(group)
        self.weight = nn.Parameter(torch.empty(out_features // size, in_features))
        self.bias = nn.Parameter(torch.empty(out_features // size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_shard W_shard^T, + b: each rank holds a slice of the input
    features."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group) -> None:
        super().__init__()
        self.group = parallel_group(group)
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp_size(group)))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return F.linear(x, self.weight, self.bias)
        # The bias is added once, after the partial products are summed over the group.
        y = reduce_from(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary; a lookup outside it gives zeros."""

    def __init__(self, vocab: int, hidden: int, group) -> None:
        super().__init__()
        self.group = parallel_group(group)
        per_rank = vocab // tp_size(group)
        self.start = tp_rank(group) * per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, hidden))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return F.embedding(tokens, self.weight)
        local = tokens - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return reduce_from(out.masked_fill(outside.unsqueeze(-1), 0.0), self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits sharded over the vocabulary, without gathering them."""

    @staticmethod
    def forward(ctx, logits, targets, start, group):
        # logits: (N, V/tp) on this rank; targets: (N,) global token ids
        logits = logits.float()
        peak = _all_reduce(logits.max(dim=-1).values, group, dist.ReduceOp.MAX)
        shifted = logits - peak.unsqueeze(-1)
        exp = shifted.exp()
        total = _all_reduce(exp.sum(dim=-1), group)
        # Each row's target logit if this rank holds it, else 0, summed over the group. Gathered
        # at a clamped index and masked, not picked by boolean indexing: no index tensor is made
        # (on the CPU or anywhere) and shapes never depend on the data.
        local = targets - start
        inside = (local >= 0) & (local < logits.shape[-1])
        index = local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)
        picked = shifted.gather(-1, index).squeeze(-1).masked_fill(~inside, 0.0)
        picked = _all_reduce(picked, group)
        ctx.save_for_backward(exp / total.unsqueeze(-1), index, inside)
        return (total.log() - picked).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, index, inside = ctx.saved_tensors
        # softmax - one_hot(target) on the rank holding the target, softmax elsewhere
        grad_logits = softmax.scatter_add(-1, index, -inside.to(softmax.dtype).unsqueeze(-1))
        return grad_logits * (grad / len(index)), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, start: int, group
) -> torch.Tensor:
    return _VocabParallelCrossEntropy.apply(logits, targets, start, group)
