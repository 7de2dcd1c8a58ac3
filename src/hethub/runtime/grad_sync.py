"""The gradient sync (Megatron-core's DDP buffers): this rank's gradients summed over every rank
holding the same parameters (every replica, and the tied GPT head's copy), bucket by bucket.

The buckets are spec.buckets.rank_buckets', which the predictor prices too; each is summed as
one flat buffer, in one of two ways:

- direct: a bucket held by exactly this rank's data-parallel peers, when they have a group (a
  sharded optimizer, an overlapped sync): each TP rank sums its own shards among its peers in one
  collective, a reduce-scatter to its slice for a sharded optimizer, else an all-reduce. With an
  overlapped sync it starts during the backwards, as soon as the bucket's gradients are final.
- through the stage leaders: each full gradient gathered in the TP group, the bucket flattened,
  all-reduced among the holders' leaders (hierarchically when they span vendors), broadcast back
  to the TP group, and each rank keeps its shards. A sharded optimizer then takes its slice.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from hethub.comm import Communicator, Pending
from hethub.runtime.model import StageChunks, shard
from hethub.runtime.optimizer import ShardedAdamW
from hethub.runtime.precision import MasterWeights
from hethub.runtime.process_groups import RankGroups
from hethub.spec.buckets import BUCKET_BYTES, rank_buckets
from hethub.spec.model import ModelSpec
from hethub.spec.parameters import Parameter
from hethub.spec.topology import Topology


class Bucket(NamedTuple):
    """Gradients synced as one flat buffer among the stages holding them."""

    params: list[tuple[str, nn.Parameter]]
    """Its parameters (their fp32 masters, whose grads are synced) by full-model name, in the
    buffer's order."""
    holders: tuple[int, ...]
    """The leaders of the stages holding them (RankGroups.grad_sync's key)."""
    direct: bool = False
    """Summed among the data-parallel peers, each TP rank its own shards."""


def sync_buckets(
    topology: Topology,
    spec: ModelSpec,
    rank: int,
    weights: MasterWeights,
    *,
    peers_have_a_group: bool,
    cap: int = BUCKET_BYTES,
) -> list[Bucket]:
    """This rank's buckets (spec.buckets.rank_buckets) over its ``weights``, fixed for the
    engine's life: its parameters are updated in place."""
    held = rank_buckets(topology, spec, rank, peers_have_a_group=peers_have_a_group, cap=cap)
    return [
        Bucket([(name, weights.by_name[name]) for name in b.names], b.holders, b.direct)
        for b in held
    ]


class GradientSync:
    """Sums this rank's bucketed gradients (see the module's docstring)."""

    def __init__(
        self,
        buckets: list[Bucket],
        comm: Communicator,
        groups: RankGroups,
        table: dict[str, Parameter],
        *,
        sharded: ShardedAdamW | None = None,
        overlap: StageChunks | None = None,
    ) -> None:
        """``table``: the model's parameters (spec.parameters), which say which TP splits;
        ``sharded``: the sharded optimizer that takes each bucket's slice of the sum (None: the
        sum stays in the parameters' grads); ``overlap``: the stage whose backward starts the
        direct buckets' sums (None: they start after the last backward)."""
        self.buckets, self.comm, self.groups, self.table = buckets, comm, groups, table
        self.sharded = sharded
        self.leads = comm.rank == groups.leader
        self.tp_rank = groups.tp.ranks.index(comm.rank)
        self.overlapped_buckets = 0  # of the last step: synced during its backwards
        self._in_flight: dict[int, Pending] = {}  # bucket -> its overlapped sum, started
        self._armed: set[int] = set()  # chunks whose next backward is their last of the step
        self._waiting: dict[int, int] = {}  # bucket -> its gradients not yet final
        if overlap is not None:
            self._hook_overlap(overlap)

    def start_step(self) -> None:
        """Before a step's first backward: no chunk's gradients are final yet."""
        self._armed.clear()
        self._waiting = {
            index: len(bucket.params) for index, bucket in enumerate(self.buckets) if bucket.direct
        }

    def arm(self, chunk: int) -> None:
        """Just before ``chunk``'s last backward of the step: the gradients that backward gives
        are final (an overlapped sync starts a bucket's sum once all of its are)."""
        self._armed.add(chunk)

    def run(self) -> None:
        """After the step's last backward: sum every bucket (waiting for those started during
        the backwards); each parameter's grad (or a sharded optimizer's slice) is then its share
        of the global batch's gradient."""
        self.overlapped_buckets = len(self._in_flight)
        for index, bucket in enumerate(self.buckets):
            if bucket.direct:
                started = self._in_flight.pop(index, None)
                pending = started if started is not None else self._start_direct(bucket)
                self._finish_direct(index, bucket, pending.wait())
                continue
            self._sync_through_leaders(bucket)
            if self.sharded is not None:
                flat = torch.cat([param.grad.reshape(-1) for _, param in bucket.params])
                self.sharded.set_grad(index, self.sharded.my_slice(self.sharded.pad(flat)))

    def gather_full(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The full-model tensor of parameter ``name`` from this stage's TP shards of it (a
        gradient, a weight, an optimizer moment): a collective of the TP group."""
        dim = self.table[name].tp_dim
        if dim is None:
            return tensor.clone()
        return self.comm.all_gather(tensor, self.groups.tp, dim)

    def _start_direct(self, bucket: Bucket) -> Pending:
        """Start summing ``bucket`` among the data-parallel peers, each its own shards: a
        reduce-scatter to this rank's slice for a sharded optimizer, else an all-reduce."""
        flat = torch.cat([param.grad.reshape(-1) for _, param in bucket.params])
        if self.sharded is not None:
            return self.comm.start_reduce_scatter(self.sharded.pad(flat), self.groups.data)
        return self.comm.start_all_reduce(flat, self.groups.data)

    def _finish_direct(self, index: int, bucket: Bucket, summed: torch.Tensor) -> None:
        if self.sharded is not None:
            self.sharded.set_grad(index, summed)
            return
        sizes = [param.numel() for _, param in bucket.params]
        for (_, param), piece in zip(bucket.params, summed.split(sizes), strict=True):
            param.grad.copy_(piece.view_as(param))

    def _sync_through_leaders(self, bucket: Bucket) -> None:
        """One bucket's sum through the stage leaders: the full gradients flattened into one
        buffer, one all-reduce among the holders' leaders, one broadcast in the TP group."""
        fulls = [self.gather_full(name, param.grad) for name, param in bucket.params]
        flat = torch.cat([full.reshape(-1) for full in fulls])
        if self.leads:  # the other TP ranks only gather and receive
            sync = self.groups.grad_sync[bucket.holders]
            if sync.bridge is not None:
                self.comm.hierarchical_all_reduce(flat, sync.local, sync.bridge)
            else:
                self.comm.all_reduce(flat, sync.local)
        self.comm.broadcast(flat, self.groups.leader, self.groups.tp)
        pieces = flat.split([full.numel() for full in fulls])
        tp = self.groups.tp.size
        for (name, param), piece, full in zip(bucket.params, pieces, fulls, strict=True):
            param.grad.copy_(shard(self.table[name], piece.view_as(full), self.tp_rank, tp))

    def _hook_overlap(self, stage: StageChunks) -> None:
        """An overlapped sync: each direct bucket's sum starts (asynchronously) once every one
        of its parameters has had its last gradient of the step, which the last backward of its
        chunk gives it (``arm``). The hooks run after AccumulateGrad (and after bf16's
        main-gradient hook, registered first), in the backward's deterministic order, so the
        peers, which run the same chunks in the same order, start their collectives in the same
        order."""
        bucket_of = {
            name: index
            for index, bucket in enumerate(self.buckets)
            if bucket.direct
            for name, _ in bucket.params
        }
        for c, chunk in enumerate(stage.chunks):
            for name, computed in chunk.full_parameters():
                index = bucket_of.get(name)
                if index is not None:
                    computed.register_post_accumulate_grad_hook(self._ready_hook(c, index))

    def _ready_hook(self, chunk: int, index: int):
        def hook(_: torch.Tensor) -> None:
            if chunk not in self._armed:
                return
            self._waiting[index] -= 1
            if not self._waiting[index]:
                self._in_flight[index] = self._start_direct(self.buckets[index])

        return hook
