"""Megatron-style tensor parallelism: column/row-parallel linears, the vocabulary-parallel
embedding and cross-entropy, over a torch.distributed process group.

The two region functions are the whole communication of a TP layer: ``copy_to`` (identity
forward, all-reduce of the input gradient backward) opens a column-parallel region, and
``reduce_from`` (all-reduce forward, identity backward) closes a row-parallel one. A group of one
rank is no group (``parallel_group``): the modules then run as plain ones, a bare F.linear or
F.embedding with no region function, and the loss is F.cross_entropy's where it can be.

Sequence parallelism (Megatron-LM's, Korthikanti et al. 2022) splits the activations outside
the TP regions (the norms', the residual's) along the sequence (dim 1 of a (B, T, h) tensor) over
the TP ranks. Its region functions take the all-reduces' place: ``gather_from_sequence``
(all-gather forward, reduce-scatter of the partial input gradient backward) opens a
column-parallel region, ``reduce_scatter_to_sequence`` (reduce-scatter forward, all-gather
backward) closes a row-parallel one: the same bytes on the wire as the all-reduce they replace.
A stage's input and output stay split (runtime.p2p sends each rank's tokens), and
``sum_gradient`` on a weight replicated over the ranks (the norms', a row-parallel bias) sums
its gradient, which each rank computes from its own tokens only.
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


class _SumGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, group):
        ctx.group = group
        return weight

    @staticmethod
    def backward(ctx, grad):
        # A new tensor for the weight's .grad: the collective's work may still hold the reduced
        # one when autograd accumulates it, which then copies it, or not, as that reference goes
        # (the layer's operations would change from run to run).
        return _all_reduce(grad.contiguous(), ctx.group).clone(), None


def sum_gradient(weight: torch.Tensor, group) -> torch.Tensor:
    """``weight`` (held whole by every rank of ``group``, used on each rank's own tokens), whose
    gradient is summed over ``group`` at each backward; no group: ``weight`` itself."""
    return weight if group is None else _SumGradient.apply(weight, group)


def copy_to(x: torch.Tensor, group) -> torch.Tensor:
    """``x``, whose gradient is all-reduced over ``group``; no group (None): ``x`` itself."""
    return x if group is None else _CopyToRegion.apply(x, group)


def reduce_from(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` all-reduced over ``group``, its gradient passed through; no group: ``x`` itself."""
    return x if group is None else _ReduceFromRegion.apply(x, group)


def _sequence_all_gather(shard: torch.Tensor, group) -> torch.Tensor:
    """(B, T/t, h) on each of the t ranks -> (B, T, h), the ranks' shards in rank order."""
    size = dist.get_world_size(group)
    # The collective concatenates along dim 0: gather (t B, T/t, h), then lay the sequence back.
    gathered = torch.empty(
        (size * shard.shape[0], *shard.shape[1:]), dtype=shard.dtype, device=shard.device
    )
    dist.all_gather_single(gathered, shard.contiguous(), group=group)
    blocks = gathered.view(size, *shard.shape)  # (t, B, T/t, h)
    if shard.shape[0] == 1:  # one sequence: (t, 1, T/t, h) is already (1, T, h) in memory
        return blocks.view(1, -1, *shard.shape[2:])
    return blocks.movedim(0, 1).flatten(1, 2)


def _sequence_reduce_scatter(whole: torch.Tensor, group) -> torch.Tensor:
    """(B, T, h) partial sums on each of the t ranks -> this rank's (B, T/t, h) of their sum."""
    size = dist.get_world_size(group)
    b, t = whole.shape[:2]
    # (t, B, T/t, h): each rank's sequence slice contiguous, as the collective splits dim 0
    blocks = whole.view(b, size, t // size, *whole.shape[2:]).movedim(1, 0).contiguous()
    shard = torch.empty(blocks.shape[1:], dtype=blocks.dtype, device=blocks.device)
    dist.reduce_scatter_single(shard, blocks.flatten(0, 1), group=group)  # (t B, T/t, h) in
    return shard


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, group):
        ctx.group = group
        return _sequence_all_gather(shard, group)

    @staticmethod
    def backward(ctx, grad):
        return _sequence_reduce_scatter(grad, ctx.group), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, whole, group):
        ctx.group = group
        return _sequence_reduce_scatter(whole, group)

    @staticmethod
    def backward(ctx, grad):
        return _sequence_all_gather(grad, ctx.group), None


def gather_from_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """The whole sequence (B, T, h) from every rank's shard ``x`` (B, T/t, h), opening a
    column-parallel region: backward, each rank's gradient is a partial sum, reduce-scattered.
    No group: ``x`` itself."""
    return x if group is None else _GatherFromSequence.apply(x, group)


def reduce_scatter_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's sequence shard (B, T/t, h) of ``x`` (B, T, h) summed over ``group`` (a
    row-parallel output); its gradient all-gathered. No group: ``x`` itself."""
    return x if group is None else _ReduceScatterToSequence.apply(x, group)


def tp_size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def tp_rank(group) -> int:
    return dist.get_rank(group) if group is not None else 0


def parallel_group(group):
    """``group`` if it spans more than one rank, else None. A one-rank group communicates
    nothing, and an autograd Function that does nothing still costs a Python call forward and
    backward for every linear of every micro-batch: the modules keep None instead."""
    return group if tp_size(group) > 1 else None


def column_region(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """A column-parallel linear's input: under sequence parallelism the caller has gathered it
    (gather_from_sequence, whose backward sums the input gradient), else ``copy_to``'s."""
    return x if sequence_parallel else copy_to(x, group)


class ColumnParallelLinear(nn.Module):
    """y_shard = x W_shard^T (+ b_shard): each rank holds a slice of the output features.
    ``sequence_parallel``: its input comes gathered from the sequence shards (column_region)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, group, sequence_parallel=False
    ) -> None:
        super().__init__()
        self.group = parallel_group(group)
        self.sequence_parallel = sequence_parallel and self.group is not None
        size = tp_size(group)
        self.weight = nn.Parameter(torch.empty(out_features // size, in_features))
        self.bias = nn.Parameter(torch.empty(out_features // size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = column_region(x, self.group, self.sequence_parallel)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_shard W_shard^T, + b: each rank holds a slice of the input
    features. ``sequence_parallel``: each rank keeps its sequence shard of y (reduce-scattered)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, group, sequence_parallel=False
    ) -> None:
        super().__init__()
        self.group = parallel_group(group)
        self.sequence_parallel = sequence_parallel and self.group is not None
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp_size(group)))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return F.linear(x, self.weight, self.bias)
        if self.sequence_parallel:
            # (B, T, h) partial sums -> this rank's (B, T/t, h) of their sum; the bias, added to
            # this rank's tokens only, has its gradient summed over the group
            y = reduce_scatter_to_sequence(F.linear(x, self.weight), self.group)
            return y + sum_gradient(self.bias, self.group) if self.bias is not None else y
        # The bias is added once, after the partial products are summed over the group.
        y = reduce_from(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary; a lookup outside it gives zeros.
    ``sequence_parallel``: the ranks' partial lookups are reduce-scattered, each rank keeping its
    sequence shard (B, T/t, h), as Megatron-LM's embedding does."""

    def __init__(self, vocab: int, hidden: int, group, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group = parallel_group(group)
        self.sequence_parallel = sequence_parallel and self.group is not None
        per_rank = vocab // tp_size(group)
        self.start = tp_rank(group) * per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, hidden))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return F.embedding(tokens, self.weight)
        local = tokens - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.group)
        return reduce_from(out, self.group)


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
