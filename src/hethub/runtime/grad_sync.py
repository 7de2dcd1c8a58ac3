"""The gradient sync (Megatron-core's DDP buffers): this rank's gradients summed over every rank
holding the same parameters (every replica, and the tied GPT head's copy), bucket by bucket.

The buckets are spec.buckets.rank_buckets', which the predictor prices too; each is one slice of
the rank's flat main gradients (runtime.flat_layout), summed in one of two ways:

- direct: a bucket held by exactly this rank's data-parallel peers, when they have a group (a
  sharded optimizer, an overlapped sync): each TP rank sums its own shards among its peers in one
  collective on the slice, in place: a reduce-scatter to its shard of it for a sharded
  optimizer, else an all-reduce. With an overlapped sync it starts during the backwards, as soon
  as the bucket's gradients are final.
- in classes: any other bucket (held by unlike layouts, the tied head's two stages) is summed in
  the classes of spec.slices.sync_classes, each among one TP rank of every stage holding it,
  each rank summing its own shard: stages of one TP degree t sum in t classes, rank i of every
  stage in the i-th, in place on the bucket's slice; between unlike TP degrees a class holds
  the part of each TP-split gradient all its ranks hold (a copy of those parts, summed and
  copied back), and the tensors whole on every TP rank (norms) in full. A class that spans
  vendors is sliced over every one of its ranks (comm.Communicator.sliced_all_reduce): nothing
  is gathered to a stage leader, and each rank carries its share over the bridge. A sharded
  optimizer then steps its shard of the slice. With an overlapped sync, the part inside this
  rank's vendor (the reduce-scatter inside the vendor where the class spans vendors, else the
  whole all-reduce) starts during the backwards, once the bucket's gradients are final,
  asynchronously. Only the exchange across the bridge and the all-gather back inside the
  vendor wait for the last backward. These buckets start in the rank's bucket order (each once
  it and those before it are final), which every holder shares for the buckets it holds
  (spec.buckets), whatever order its own backwards finish them in; the sums are the same
  collectives as without overlap, so they are the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hethub.comm import Communicator, Pending, SlicedSum
from hethub.runtime.model import StageChunks
from hethub.runtime.optimizer import ShardedAdamW
from hethub.runtime.precision import MasterWeights
from hethub.runtime.process_groups import RankGroups, SyncGroups
from hethub.spec.buckets import SyncBucket
from hethub.spec.parameters import Parameter
from hethub.spec.slices import SyncClass

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


class _ClassSum(NamedTuple):
    """One class of a bucket's sum (spec.slices.sync_classes) as this rank runs it."""

    flat: torch.Tensor
    """What is summed: the bucket's slice of the main gradients where the class covers all
    this rank holds of it, else a copy of its parts."""
    parts: list[torch.Tensor] | None
    """Where ``flat`` was copied from, and where its sum goes back (None: summed in place)."""
    groups: SyncGroups
    local: Pending | SlicedSum | None
    """The sum inside the vendor, started during the backwards (None: not started)."""


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
        self.tp_rank = groups.tp.ranks.index(comm.rank)
        self.overlapped_buckets = 0  # of the last step: started during its backwards
        self._in_flight: dict[int, Pending] = {}  # bucket -> its overlapped sum, started
        self._started: dict[int, list[_ClassSum]] = {}  # bucket -> its classes, started
        self._final: set[int] = set()  # buckets summed in classes, final, not yet started
        self._next_in_classes = 0  # of _in_classes: the next to start
        self._in_classes = [i for i, bucket in enumerate(buckets) if not bucket.direct]
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
        self._next_in_classes = 0

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
                    started = self._start_classes(index, bucket, overlapped=False)
                self._finish_classes(started)

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

    def _start_classes(self, index: int, bucket: Bucket, *, overlapped: bool) -> list[_ClassSum]:
        """Start one bucket's sum in its classes, as far as it stays inside this rank's vendor:
        each class's share taken from the main gradients (copied where the class holds part of
        what this rank does), then, ``overlapped``, the sum among its ranks of this vendor
        started (all of it where the class is of one vendor; where it spans vendors, the
        reduce-scatter of the sliced sum), asynchronously as a direct bucket's sum. Every
        class's share is taken before any sum is written back: a tensor whole on every TP rank
        is in each of this rank's classes, and each sums the gradient as the backwards left it."""
        sums = []
        for in_class in self.groups.grad_sync[bucket.holders]:
            flat, parts = self._class_share(index, bucket, in_class.share)
            groups, local = in_class.groups, None
            if overlapped and groups.bridge is not None:
                local = self.comm.start_sliced_all_reduce(flat, groups.local, groups.bridge)
            elif overlapped and groups.local.size > 1:
                local = self.comm.start_all_reduce(flat, groups.local)
            sums.append(_ClassSum(flat, parts, groups, local))
        return sums

    def _finish_classes(self, sums: list[_ClassSum]) -> None:
        """The rest of one bucket's sum in its classes (of a class not started, all of it): the
        exchange across vendors and the all-gather back inside the vendor; then each copied
        share back into the main gradients."""
        for summing in sums:
            if summing.local is None:
                self._class_sum(summing.flat, summing.groups)
            elif isinstance(summing.local, SlicedSum):
                self.comm.finish_sliced_all_reduce(summing.local)
            else:
                summing.local.wait()
        for summing in sums:
            if summing.parts is not None:
                sizes = [part.numel() for part in summing.parts]
                for part, summed in zip(summing.parts, summing.flat.split(sizes), strict=True):
                    part.copy_(summed.view_as(part))

    def _class_share(
        self, index: int, bucket: Bucket, share: SyncClass
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """What this rank sums of bucket ``index`` in class ``share``: the bucket's slice of
        the main gradients itself where the class covers every unit this rank holds, else a
        copy of the parts it covers (each TP-split gradient narrowed along its split dimension
        to the class's run, each whole one entire), in bucket order, and those parts."""
        held = share.units // self.groups.tp.size  # units of each split dimension this rank holds
        if share.stop - share.start == held:
            return self.weights.bucket_grads(index), None
        first = self.tp_rank * held
        parts = []
        for name, _ in bucket.params:
            grad, dim = self.weights.grad(name), self.table[name].tp_dim
            if dim is None:
                parts.append(grad)
                continue
            unit = grad.shape[dim] // held
            parts.append(
                grad.narrow(dim, (share.start - first) * unit, (share.stop - share.start) * unit)
            )
        return torch.cat([part.reshape(-1) for part in parts]), parts

    def _class_sum(self, flat: torch.Tensor, groups: SyncGroups) -> None:
        """Sum ``flat`` in place among its class's ranks. Across vendors, an overlapped sync sums
        as its started buckets do (start_sliced_all_reduce), whose collectives every rank of
        the class then runs whichever of its buckets it started."""
        if groups.bridge is not None and self._ready:
            started = self.comm.start_sliced_all_reduce(flat, groups.local, groups.bridge)
            self.comm.finish_sliced_all_reduce(started)
        elif groups.bridge is not None:
            self.comm.sliced_all_reduce(flat, groups.local, groups.bridge)
        else:
            self.comm.all_reduce(flat, groups.local)

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
        """Start the buckets summed in classes that are final, in bucket order: up to the
        first that is not. A holder set's buckets, and holder sets sharing a vendor's group,
        then start in the same order on every holder, whatever order its backwards finish
        them in."""
        order = self._in_classes
        while self._next_in_classes < len(order):
            index = order[self._next_in_classes]
            if index not in self._final:
                return
            self._final.discard(index)
            bucket = self.buckets[index]
            self._started[index] = self._start_classes(index, bucket, overlapped=True)
            self._next_in_classes += 1

    def _disarm(self) -> None:
        for handle in self._armed:
            handle.remove()
        self._armed.clear()
