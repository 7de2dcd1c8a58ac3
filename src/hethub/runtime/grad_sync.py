"""The gradient sync (Megatron-core's DDP buffers): this rank's gradients summed over every rank
holding the same parameters (every replica, and the tied GPT head's copy), bucket by bucket.

The buckets are spec.buckets.rank_buckets', which the predictor prices too; each is one slice of
the rank's flat main gradients (runtime.flat_layout), summed in one of two ways:

- direct: a bucket held by exactly this rank's data-parallel peers, when they have a group (a
  sharded optimizer, an overlapped sync): each TP rank sums its own shards among its peers in one
  collective on the slice, in place: a reduce-scatter to its shard of it for a sharded
  optimizer, else an all-reduce. With an overlapped sync it starts during the backwards, as soon
  as the bucket's gradients are final.
- through the stage leaders: all-reduced among the holders' leaders (hierarchically when they
  span vendors), in place on the slice; with TP, each full gradient is first gathered in the TP
  group into one flat buffer, which is broadcast back to the TP group after the sum, and each
  rank keeps its shards. A sharded optimizer then steps its shard of the slice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hethub.comm import Communicator, Pending
from hethub.runtime.model import StageChunks, shard
from hethub.runtime.optimizer import ShardedAdamW
from hethub.runtime.precision import MasterWeights
from hethub.runtime.process_groups import RankGroups
from hethub.spec.buckets import SyncBucket
from hethub.spec.parameters import Parameter

Hook = Callable[[torch.Tensor], None]
"""A post-accumulate-grad hook."""


class Bucket(NamedTuple):
    """Gradients synced as one flat buffer among the stages holding them."""

    params: list[tuple[str, nn.Parameter]]
    """Its parameters (their fp32 masters, whose grads are synced) by full-model name, in the
    buffer's order."""
    holders: tuple[int, ...]
    """The leaders of the stages holding them (RankGroups.grad_sync's key)."""
    direct: bool = False
    """Summed among the data-parallel peers, each TP rank its own shards."""


def sync_buckets(held: Sequence[SyncBucket], weights: MasterWeights) -> list[Bucket]:
    """This rank's buckets ``held`` (spec.buckets.rank_buckets, which laid out ``weights``)
    over its ``weights``, fixed for the engine's life: its parameters are updated in place."""
    return [
        Bucket([(name, weights.by_name[name]) for name in b.names], b.holders, b.direct)
        for b in held
    ]


class GradientSync:
    """Sums this rank's bucketed gradients (see the module's docstring)."""

    def __init__(
        self,
        buckets: list[Bucket],
        weights: MasterWeights,
        comm: Communicator,
        groups: RankGroups,
        table: dict[str, Parameter],
        *,
        sharded: ShardedAdamW | None = None,
        overlap: StageChunks | None = None,
    ) -> None:
        """``weights``: whose main gradients are summed, laid out by ``buckets``; ``table``:
        the model's parameters (spec.parameters), which say which TP splits; ``sharded``: the
        sharded optimizer that steps each bucket's shard of the sum (None: every gradient is
        summed whole); ``overlap``: the stage whose backward starts the direct buckets' sums
        (None: they start after the last backward)."""
        self.buckets, self.weights, self.comm = buckets, weights, comm
        self.groups, self.table = groups, table
        self.sharded = sharded
        self.leads = comm.rank == groups.leader
        self.tp_rank = groups.tp.ranks.index(comm.rank)
        self.overlapped_buckets = 0  # of the last step: synced during its backwards
        self._in_flight: dict[int, Pending] = {}  # bucket -> its overlapped sum, started
        self._waiting: dict[int, int] = {}  # bucket -> its gradients not yet final
        self._ready: list[list[tuple[nn.Parameter, Hook]]] = []  # per chunk: (param, its hook)
        self._armed: list[RemovableHandle] = []  # the hooks set for this step's last backwards
        if overlap is not None:
            self._ready = self._ready_hooks(overlap)

    def start_step(self) -> None:
        """Before a step's first backward: the main gradients zero, none of them final."""
        self._disarm()
        self.weights.zero_grad()
        self._waiting = {
            index: len(bucket.params) for index, bucket in enumerate(self.buckets) if bucket.direct
        }

    def arm(self, chunk: int) -> None:
        """Just before ``chunk``'s last backward of the step: the gradients that backward gives
        are final; an overlapped sync hooks them to start each bucket's sum once all of its
        are. (Hooked for that backward alone: no Python call per parameter in the others.)"""
        if self._ready:
            for param, hook in self._ready[chunk]:
                self._armed.append(param.register_post_accumulate_grad_hook(hook))

    def run(self) -> None:
        """After the step's last backward: sum every bucket (waiting for those started during
        the backwards); each parameter's main gradient (or a sharded optimizer's shard of it)
        is then its share of the global batch's gradient."""
        self._disarm()
        self.overlapped_buckets = len(self._in_flight)
        for index, bucket in enumerate(self.buckets):
            if bucket.direct:
                started = self._in_flight.pop(index, None)
                (started if started is not None else self._start_direct(index)).wait()
            else:
                self._sync_through_leaders(index, bucket)

    def gather_full(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The full-model tensor of parameter ``name`` from this stage's TP shards of it (a
        gradient, a weight, an optimizer moment): a collective of the TP group."""
        dim = self.table[name].tp_dim
        if dim is None:
            return tensor.clone()
        return self.comm.all_gather(tensor, self.groups.tp, dim)

    def _start_direct(self, index: int) -> Pending:
        """Start summing bucket ``index`` among the data-parallel peers, each its own shards, in
        place: a reduce-scatter to this rank's shard of it for a sharded optimizer, else an
        all-reduce."""
        if self.sharded is not None:
            padded = self.weights.bucket_grads(index, padded=True)
            out = self.sharded.grad_shard(index)
            return self.comm.start_reduce_scatter(padded, self.groups.data, out)
        return self.comm.start_all_reduce(self.weights.bucket_grads(index), self.groups.data)

    def _sync_through_leaders(self, index: int, bucket: Bucket) -> None:
        """One bucket's sum through the stage leaders: one all-reduce among the holders'
        leaders of the bucket's slice of the main gradients; with TP, of the full gradients
        gathered into one buffer, then broadcast in the TP group and each rank's shards kept."""
        if self.groups.tp.size == 1:
            self._leaders_sum(self.weights.bucket_grads(index), bucket.holders)
            return
        grads = [self.weights.grad(name) for name, _ in bucket.params]
        fulls = [self.gather_full(name, g) for (name, _), g in zip(bucket.params, grads)]
        flat = torch.cat([full.reshape(-1) for full in fulls])
        if self.leads:  # the other TP ranks only gather and receive
            self._leaders_sum(flat, bucket.holders)
        self.comm.broadcast(flat, self.groups.leader, self.groups.tp)
        pieces = flat.split([full.numel() for full in fulls])
        tp = self.groups.tp.size
        for (name, _), grad, piece, full in zip(bucket.params, grads, pieces, fulls, strict=True):
            grad.copy_(shard(self.table[name], piece.view_as(full), self.tp_rank, tp))

    def _leaders_sum(self, flat: torch.Tensor, holders: tuple[int, ...]) -> None:
        """Sum ``flat`` in place among the leaders of the stages ``holders``."""
        sync = self.groups.grad_sync[holders]
        if sync.bridge is not None:
            self.comm.hierarchical_all_reduce(flat, sync.local, sync.bridge)
        else:
            self.comm.all_reduce(flat, sync.local)

    def _ready_hooks(self, stage: StageChunks) -> list[list[tuple[nn.Parameter, Hook]]]:
        """An overlapped sync: per chunk, the parameters in direct buckets (the stage's own,
        which compute: bf16 ones in bf16) and the hook that counts each one's last gradient of
        the step. The hooks run after AccumulateGrad, in the backward's deterministic order, so
        the peers, which run the same chunks in the same order, start their collectives in the
        same order."""
        bucket_of = {
            name: index
            for index, bucket in enumerate(self.buckets)
            if bucket.direct
            for name, _ in bucket.params
        }
        return [
            [
                (computed, self._ready_hook(bucket_of[name]))
                for name, computed in chunk.full_parameters()
                if name in bucket_of
            ]
            for chunk in stage.chunks
        ]

    def _ready_hook(self, index: int) -> Hook:
        def hook(_: torch.Tensor) -> None:
            self._waiting[index] -= 1
            if not self._waiting[index]:
                self.weights.bucket_done(index)  # bf16: its last gradients into the main ones
                self._in_flight[index] = self._start_direct(index)

        return hook

    def _disarm(self) -> None:
        for handle in self._armed:
            handle.remove()
        self._armed.clear()
