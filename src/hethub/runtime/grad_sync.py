"""The gradient sync (Megatron-core's DDP buffers): this rank's gradients summed over every rank
holding the same parameters (every replica, and the tied GPT head's copy), bucket by bucket.

The buckets are spec.buckets.rank_buckets', which the predictor prices too; each is one slice of
the rank's flat main gradients (runtime.flat_layout), summed in one of two ways:

- direct: a bucket held by exactly this rank's data-parallel peers, when they have a group (a
  sharded optimizer, an overlapped sync): each TP rank sums its own shards among its peers in one
  collective on the slice, in place: a reduce-scatter to its shard of it for a sharded
  optimizer, else an all-reduce. With an overlapped sync it starts during the backwards, as soon
  as the bucket's gradients are final.
- through the stage leaders: all-reduced among the holders' leaders (when they span vendors,
  sliced over every leader: comm.Communicator.sliced_all_reduce), in place on the slice; with
  TP, each full gradient is first gathered in the TP group into one flat buffer, which is
  broadcast back to the TP group after the sum, and each rank keeps its shards. A sharded
  optimizer then steps its shard of the slice. With an overlapped sync, the part inside this
  rank's vendor starts during the backwards too, once the bucket's gradients are final: the TP
  gather, then the sum among the vendor's leaders (the reduce-scatter inside the vendor where
  the holders span vendors, else the whole all-reduce), asynchronously. Only the exchange
  across the bridge and what follows it (the all-gather back inside the vendor, the broadcast
  in the TP group) wait for the last backward. (The TP gather to the stage leader stays: a TP
  rank does not yet sum its own shard across vendors.) These buckets start in the rank's
  bucket order (each once it and those before it are final), which every holder shares for
  the buckets it holds (spec.buckets), whatever order its own backwards finish them in; the
  sums are the same collectives as without overlap, so they are the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hethub.comm import Communicator, Pending, SlicedSum
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


class _Started(NamedTuple):
    """A bucket synced through the stage leaders whose part inside the vendor was started
    during the backwards."""

    flat: torch.Tensor
    """What is summed: the bucket's slice of the main gradients, or with TP its gathered full
    gradients."""
    fulls: list[torch.Tensor] | None
    """With TP: the full gradients ``flat`` concatenates (None without TP)."""
    local: Pending | SlicedSum | None
    """The leaders' sum inside the vendor, under way: across vendors, the sliced sum's
    reduce-scatter (None off the leader, or where the set is this leader alone)."""


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
        self.overlapped_buckets = 0  # of the last step: started during its backwards
        self._in_flight: dict[int, Pending] = {}  # bucket -> its overlapped sum, started
        self._started: dict[int, _Started] = {}  # bucket -> its part inside the vendor, started
        self._final: set[int] = set()  # buckets through the leaders, final, not yet started
        self._next_through_leaders = 0  # of _through_leaders: the next to start
        self._through_leaders = [i for i, bucket in enumerate(buckets) if not bucket.direct]
        self._waiting: dict[int, int] = {}  # bucket -> its gradients not yet final
        self._ready: list[list[tuple[nn.Parameter, Hook]]] = []  # per chunk: (param, its hook)
        self._armed: list[RemovableHandle] = []  # the hooks set for this step's last backwards
        if overlap is not None:
            self._ready = self._ready_hooks(overlap)

    def start_step(self) -> None:
        """Before a step's first backward: the main gradients zero, none of them final."""
        self._disarm()
        self.weights.zero_grad()
        self._waiting = {index: len(bucket.params) for index, bucket in enumerate(self.buckets)}
        self._final.clear()
        self._next_through_leaders = 0

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
        self.overlapped_buckets = len(self._in_flight) + len(self._started)
        for index, bucket in enumerate(self.buckets):
            if bucket.direct:
                started = self._in_flight.pop(index, None)
                (started if started is not None else self._start_direct(index)).wait()
            else:
                started = self._started.pop(index, None)
                if started is None:  # not overlapped: the whole sum from here
                    started = self._start_through_leaders(index, bucket, overlapped=False)
                self._finish_through_leaders(bucket, started)

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

    def _start_through_leaders(self, index: int, bucket: Bucket, *, overlapped: bool) -> _Started:
        """Start one bucket's sum through the stage leaders, as far as it stays inside this
        rank's vendor: with TP, gather the full gradients in the TP group into one buffer; then,
        ``overlapped``, on the leader start the sum among its vendor's leaders of the holders
        (all of it where they are of one vendor; where they span vendors, the reduce-scatter
        of the sliced sum), asynchronously as a direct bucket's sum."""
        if self.groups.tp.size == 1:
            flat, fulls = self.weights.bucket_grads(index), None
        else:
            grads = [self.weights.grad(name) for name, _ in bucket.params]
            fulls = [self.gather_full(name, g) for (name, _), g in zip(bucket.params, grads)]
            flat = torch.cat([full.reshape(-1) for full in fulls])
        local = None
        if overlapped and self.leads:  # the other TP ranks only gather and receive
            sync = self.groups.grad_sync[bucket.holders]
            if sync.bridge is not None:
                local = self.comm.start_sliced_all_reduce(flat, sync.local, sync.bridge)
            elif sync.local.size > 1:
                local = self.comm.start_all_reduce(flat, sync.local)
        return _Started(flat, fulls, local)

    def _finish_through_leaders(self, bucket: Bucket, started: _Started) -> None:
        """The rest of one bucket's sum through the stage leaders (on a leader whose vendor's
        part was not started, all of it): the exchange across vendors and the all-gather back
        inside the vendor; with TP, the broadcast of the sum in the TP group, each rank keeping
        its shards."""
        flat = started.flat
        if self.leads and started.local is None:
            self._leaders_sum(flat, bucket.holders)
        elif isinstance(started.local, SlicedSum):
            self.comm.finish_sliced_all_reduce(started.local)
        elif self.leads:
            started.local.wait()
        if started.fulls is None:
            return
        self.comm.broadcast(flat, self.groups.leader, self.groups.tp)
        pieces = flat.split([full.numel() for full in started.fulls])
        tp = self.groups.tp.size
        for (name, _), piece, full in zip(bucket.params, pieces, started.fulls, strict=True):
            grad = self.weights.grad(name)
            grad.copy_(shard(self.table[name], piece.view_as(full), self.tp_rank, tp))

    def _leaders_sum(self, flat: torch.Tensor, holders: tuple[int, ...]) -> None:
        """Sum ``flat`` in place among the leaders of the stages ``holders``. Across vendors,
        an overlapped sync sums as its started buckets do (start_sliced_all_reduce), whose
        collectives every holder then runs whichever of its buckets it started."""
        sync = self.groups.grad_sync[holders]
        if sync.bridge is not None and self._ready:
            started = self.comm.start_sliced_all_reduce(flat, sync.local, sync.bridge)
            self.comm.finish_sliced_all_reduce(started)
        elif sync.bridge is not None:
            self.comm.sliced_all_reduce(flat, sync.local, sync.bridge)
        else:
            self.comm.all_reduce(flat, sync.local)

    def _ready_hooks(self, stage: StageChunks) -> list[list[tuple[nn.Parameter, Hook]]]:
        """An overlapped sync: per chunk, the parameters in buckets (the stage's own, which
        compute: bf16 ones in bf16) and the hook that counts each one's last gradient of the
        step. The hooks run after AccumulateGrad, in the backward's deterministic order, so the
        peers, which run the same chunks in the same order, start their direct collectives in
        the same order (the others start in bucket order: ``_start_final``)."""
        bucket_of = {
            name: index for index, bucket in enumerate(self.buckets) for name, _ in bucket.params
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
                if self.buckets[index].direct:
                    self._in_flight[index] = self._start_direct(index)
                else:
                    self._final.add(index)
                    self._start_final()

        return hook

    def _start_final(self) -> None:
        """Start the buckets through the leaders that are final, in bucket order: up to the
        first that is not. A holder set's buckets, and holder sets sharing a vendor's group,
        then start in the same order on every holder, whatever order its backwards finish
        them in."""
        order = self._through_leaders
        while self._next_through_leaders < len(order):
            index = order[self._next_through_leaders]
            if index not in self._final:
                return
            self._final.discard(index)
            bucket = self.buckets[index]
            self._started[index] = self._start_through_leaders(index, bucket, overlapped=True)
            self._next_through_leaders += 1

    def _disarm(self) -> None:
        for handle in self._armed:
            handle.remove()
        self._armed.clear()
