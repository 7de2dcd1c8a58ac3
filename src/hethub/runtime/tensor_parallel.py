"""Megatron-style tensor parallelism: column/row-parallel linears, the vocabulary-parallel
embedding and cross-entropy, over a torch.distributed process group.

The two region functions are the whole communication of a TP layer: ``copy_to`` (identity
forward, all-reduce of the input gradient backward) opens a column-parallel region, and
``reduce_from`` (all-reduce forward, identity backward) closes a row-parallel one. A group of one
rank is no group (``parallel_group``): the modules then run as plain ones, a bare F.linear or
F.embedding with no region function, and the loss is F.cross_entropy's where it can be.
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


def _target_slots(
    targets: torch.Tensor, start: int, width: int, group
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's target as an index into this rank's ``width`` logits from vocabulary id
    ``start``, (N, 1), and whether this rank holds it, (N,); no group: every target is here
    (None). Clamped and masked, not picked by boolean indexing: no index tensor is made (on the
    CPU or anywhere) and shapes never depend on the data."""
    if group is None:
        return targets.unsqueeze(-1), None
    local = targets - start
    inside = (local >= 0) & (local < width)
    return local.clamp(0, width - 1).unsqueeze(-1), inside


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy, in fp32, of logits sharded over the vocabulary, without gathering
    them: one all-reduce each of the rows' peaks, of their sums of exponentials and of their
    target logits.

    It keeps for the backward the logits themselves, in their own dtype, and each row's fp32
    log-sum-exp (N floats), and recomputes the softmax from them in fp32 there: no fp32 copy of
    the (N, V/tp) logits lives from the forward to the backward. Each pass makes one fp32
    (N, V/tp) tensor for its own duration (the forward's exponentials, the backward's softmax,
    which becomes the gradient in place); the backward's gradient in the logits' dtype is a
    second (N, V/tp) tensor in bf16.
    """

    @staticmethod
    def forward(ctx, logits, targets, start, group):
        # logits: (N, V/tp) on this rank, any float dtype; targets: (N,) global token ids
        peak = _all_reduce(logits.amax(dim=-1).float(), group, dist.ReduceOp.MAX)  # (N,)
        # bf16 logits minus fp32 peaks: fp32 values in one pass, with no fp32 copy of the logits
        total = _all_reduce((logits - peak.unsqueeze(-1)).exp_().sum(dim=-1), group)  # (N,)
        log_sum_exp = peak.add_(total.log_())  # (N,), fp32
        index, inside = _target_slots(targets, start, logits.shape[-1], group)
        target_logit = logits.gather(-1, index).squeeze(-1)  # (N,)
        if inside is None:
            ctx.save_for_backward(logits, log_sum_exp, index)
        else:  # the rank holding a row's target gives its logit; the others, 0
            target_logit = _all_reduce(target_logit.float().masked_fill_(~inside, 0.0), group)
            # -1 at the targets this rank holds, 0 elsewhere: the one-hot the backward takes
            # from the softmax
            hits = inside.unsqueeze(-1).to(torch.float32).neg_()
            ctx.save_for_backward(logits, log_sum_exp, index, hits)
        return (log_sum_exp - target_logit).mean()

    @staticmethod
    def backward(ctx, grad):
        logits, log_sum_exp, index, *hits = ctx.saved_tensors
        # softmax - one_hot(target) on the rank holding the target, softmax elsewhere
        grad_logits = (logits - log_sum_exp.unsqueeze(-1)).exp_()
        if hits:
            grad_logits.scatter_add_(-1, index, hits[0])
        else:  # every target is here: a scalar -1 at each, no one-hot tensor made or kept
            grad_logits.scatter_(-1, index, -1.0, reduce="add")
        scale = grad / len(index)
        return grad_logits.mul_(scale).to(logits.dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, start: int, group
) -> torch.Tensor:
    """Mean token cross-entropy, fp32, of ``logits`` (N, V/tp), this rank's slice of the
    vocabulary from ``start``, against ``targets`` (N,) (global token ids). Unsharded fp32 logits
    are F.cross_entropy's; otherwise the loss is _VocabParallelCrossEntropy's, which computes in
    fp32 whatever the logits' dtype: F.cross_entropy on bf16 logits rounds the log-probabilities
    and the loss to bf16 (a loss near 6 off by 0.02, a gradient 1.2-3.6x further from the exact
    one than the exact one rounded to bf16), and on an fp32 copy of them keeps that copy for the
    backward."""
    group = parallel_group(group)
    if group is None and logits.dtype == torch.float32:
        return F.cross_entropy(logits, targets)
    return _VocabParallelCrossEntropy.apply(logits, targets, start, group)
