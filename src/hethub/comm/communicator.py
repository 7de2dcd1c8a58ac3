"""Every message and collective between ranks, natively inside a vendor and over a host-staged
bridge across vendors, each counting the bytes it moves on its path.

No collective library spans two vendors (NCCL cannot talk to HCCL), so traffic between groups of
different vendors is copied to host memory and sent over gloo, which every machine has; the
bytes count as the bridge's. Traffic between ranks of one vendor counts as native. Each message
and collective goes through the group (comm.Group) the caller gives it; a tensor on an
accelerator is staged through host memory when that group runs on gloo.

A method both runs its collective and counts what it moves out of this rank, by the ring
factors of spec.collectives.moved_bytes, which the predictor's plan of a step's traffic counts
by too: an all-reduce moves 2 (n - 1) / n of its tensor, a reduce-scatter (n - 1) / n of its
input, an all-gather n - 1 times its piece, a broadcast the tensor once on every rank, a
message its bytes at each end. Bookkeeping outside the training traffic (the step's loss
report, a checkpoint's gathers) runs under ``not_counted``.

A sum across vendors is sliced over every holder (``sliced_all_reduce``, spec.slices): each
crosses the bridge with its own piece, all at once, so the busiest rank's bridge bytes are 1/k
of what the first rank of a vendor sent when it carried the whole tensor
(``hierarchical_all_reduce``, the funnel, kept for comparison). Host staging borrows its buffers
from a pool kept across steps (comm.staging), and a large bridged piece goes in chunks of
``BRIDGE_CHUNK_BYTES``, each sent while the device copies the next to the host.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from hethub.comm.group import Group, SlicedBridge
from hethub.comm.staging import StagingPool
from hethub.spec.collectives import BRIDGE, NATIVE, Kind, moved_bytes, path_of
from hethub.spec.slices import bridge_slices, padded_length, slice_units

BRIDGE_CHUNK_BYTES = 8 << 20
"""How much of a bridged piece is staged and sent as one gloo collective: large enough that a
message's own cost is a small share of its time, small enough that a vendor's piece still goes
in several chunks, so that the device's copy of each to the host hides behind the sending of
the one before (benchmarks/bridge.py measures it; docs/runtime.md has the figures)."""

Work = dist.Work
"""A message or collective under way (``Communicator.wait`` finishes a message)."""


class Pending(NamedTuple):
    """A collective started asynchronously: ``wait`` gives its result."""

    work: Work
    result: torch.Tensor

    def wait(self) -> torch.Tensor:
        """Block until the collective is done; its result."""
        self.work.wait()
        return self.result


class SlicedSum(NamedTuple):
    """A sliced all-reduce whose reduce-scatter inside the vendor is under way."""

    tensor: torch.Tensor
    """What is summed, in place."""
    flat: torch.Tensor
    """The tensor flat (a padded copy where the slices need whole elements)."""
    piece: torch.Tensor
    """This rank's piece of ``flat``: its share of the vendor's reduce-scatter."""
    local: Group
    bridge: SlicedBridge
    work: Work | None
    """The reduce-scatter (None where this rank is its vendor's only holder)."""


class Communicator:
    """This rank's view: which path reaches which peer, and the bytes moved on each."""

    def __init__(
        self,
        vendors: Sequence[str],
        timeout: timedelta | None = None,
        *,
        chunk_bytes: int = BRIDGE_CHUNK_BYTES,
    ) -> None:
        """``vendors``: every rank's accelerator vendor, in rank order; ``timeout``: how long a
        message may take (None: forever); ``chunk_bytes``: how much of a bridged piece is
        staged and sent at once (BRIDGE_CHUNK_BYTES: measured). Collectives time out by their
        process group's timeout; a point-to-point wait in gloo does not, and would wait
        forever on a peer that stopped (SIGSTOP, a hung device) without dying."""
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.timeout = timeout
        self.vendor = list(vendors)
        self.bytes = {NATIVE: 0, BRIDGE: 0}
        self._counting = True
        self.chunk_bytes = chunk_bytes
        self.staging = StagingPool()
        """The host buffers bridged traffic from an accelerator is staged in."""

    def path(self, *ranks: int) -> str:
        """NATIVE when every rank is of one vendor, else BRIDGE."""
        return path_of(ranks, self.vendor)

    @contextmanager
    def not_counted(self) -> Iterator[None]:
        """What runs inside moves its bytes uncounted: bookkeeping outside the training step's
        traffic, which the step log reports and the predictor prices without it."""
        counting, self._counting = self._counting, False
        try:
            yield
        finally:
            self._counting = counting

    # --- point to point ------------------------------------------------------------------------

    def isend(
        self, tensor: torch.Tensor, peer: int, group: Group | None = None, *, tag: int = 0
    ) -> Work:
        """Start sending ``tensor`` to global rank ``peer`` through ``group`` (None: the world
        group), matched by ``tag`` at the receiver; ``wait`` for the work before the tensor
        changes."""
        self._count(Kind.SEND, (self.rank, peer), tensor)
        handle = _handle(group)
        if not _needs_staging(tensor, handle):
            return dist.isend(tensor, peer, group=handle, tag=tag)
        host = self.staging.take(tensor.numel(), tensor.dtype).view(tensor.shape)
        host.copy_(tensor)  # the host needs the data now: this waits for the device
        work = dist.isend(host, peer, group=handle, tag=tag)
        self.staging.give_back(host, work.is_completed)
        return work

    def recv(
        self, buffer: torch.Tensor, peer: int, group: Group | None = None, *, tag: int = 0
    ) -> torch.Tensor:
        """Receive into ``buffer`` from global rank ``peer`` through ``group`` (None: the world),
        the message sent with ``tag``."""
        handle = _handle(group)
        if not _needs_staging(buffer, handle):
            self.wait(dist.irecv(buffer, peer, group=handle, tag=tag))
        else:
            host = self.staging.take(buffer.numel(), buffer.dtype).view(buffer.shape)
            self.wait(dist.irecv(host, peer, group=handle, tag=tag))
            self.staging.give_back(host, _copied_back(buffer, host))
        self._count(Kind.RECV, (self.rank, peer), buffer)
        return buffer

    def wait(self, work: Work) -> None:
        """Wait for a point-to-point ``work`` within the timeout (RuntimeError past it)."""
        if self.timeout is None:
            work.wait()
        else:
            work.wait(self.timeout)

    # --- collectives ---------------------------------------------------------------------------

    def barrier(self) -> None:
        """Every rank of the job meets here (no data moves); alone, nothing to meet."""
        if self.world_size > 1:
            dist.barrier()

    def all_reduce(self, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        """Sum ``tensor`` in place over ``group`` (this rank among its ranks)."""
        if group.size == 1:
            return tensor
        self._count(Kind.ALL_REDUCE, group.ranks, tensor)
        self._collective(dist.all_reduce, tensor, group.handle)
        return tensor

    def hierarchical_all_reduce(
        self, tensor: torch.Tensor, local: Group, bridge: Group
    ) -> torch.Tensor:
        """The funnel, kept to measure the sliced sum against (benchmarks/bridge.py): sum
        ``tensor`` in place over ranks of several vendors by reducing it to the first rank of
        this rank's vendor part (``local``, natively), all-reducing among those first ranks
        (``bridge``, one per vendor, host-staged), and broadcasting the sum back inside the
        part. One rank and one link carry each vendor's whole tensor."""
        first = local.ranks[0]
        if local.size > 1:
            self._count(Kind.REDUCE, local.ranks, tensor)
            self._collective(dist.reduce, tensor, local.handle, dst=first)
        if self.rank == first:
            self.all_reduce(tensor, bridge)
        if local.size > 1:
            self._count(Kind.BROADCAST, local.ranks, tensor)
            self._collective(dist.broadcast, tensor, local.handle, src=first)
        return tensor

    def sliced_all_reduce(
        self, tensor: torch.Tensor, local: Group, bridge: SlicedBridge
    ) -> torch.Tensor:
        """Sum ``tensor`` in place over the holders of several vendors (``bridge.parts``), every
        holder carrying its share over the bridge (spec.slices): reduce-scatter inside this
        rank's vendor (``local``, natively), all-reduce each of this rank's slices with its
        owners on the other vendors (host-staged, every slice of every rank at once), and
        all-gather the sum back inside the vendor. Each rank sends 1/k of what a funnel's
        first rank sent over the bridge, for k holders on its vendor.

        Where ``local`` runs on gloo (CPU ranks), its reduce-scatter and all-gather are rings
        of sends (``_ring_reduce_scatter``): gloo's own are slower than its all-reduce. They
        block, so the overlapped sync, which starts the reduce-scatter from a backward hook,
        uses ``start_sliced_all_reduce`` instead (the sums are the same)."""
        if local.size == 1 or dist.get_backend(local.handle) != "gloo":
            return self.finish_sliced_all_reduce(
                self.start_sliced_all_reduce(tensor, local, bridge)
            )
        flat, piece = self._sliced_flat(tensor, local, bridge)
        self._count(Kind.REDUCE_SCATTER, local.ranks, flat)
        self._ring_reduce_scatter(flat, local)
        self._bridge_slices(flat, bridge)
        self._count(Kind.ALL_GATHER, local.ranks, piece)
        self._ring_all_gather(flat, local)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.view(-1).copy_(flat[: tensor.numel()])
        return tensor

    def start_sliced_all_reduce(
        self, tensor: torch.Tensor, local: Group, bridge: SlicedBridge
    ) -> SlicedSum:
        """Start the part of ``sliced_all_reduce`` that stays inside this rank's vendor, the
        reduce-scatter, asynchronously with the backend's own collective;
        ``finish_sliced_all_reduce`` does the rest. (Native, as ``start_all_reduce``.)"""
        flat, piece = self._sliced_flat(tensor, local, bridge)
        work = None
        if local.size > 1:
            self._count(Kind.REDUCE_SCATTER, local.ranks, flat)
            work = dist.reduce_scatter_single(piece, flat, group=local.handle, async_op=True)
        return SlicedSum(tensor, flat, piece, local, bridge, work)

    def finish_sliced_all_reduce(self, started: SlicedSum) -> torch.Tensor:
        """The rest of ``sliced_all_reduce`` once its reduce-scatter is started: this rank's
        slices across the bridge, all at once, then the all-gather inside the vendor. The
        summed tensor."""
        flat, piece, local = started.flat, started.piece, started.local
        if started.work is not None:
            started.work.wait()
        self._bridge_slices(flat, started.bridge)
        if local.size > 1:
            self._count(Kind.ALL_GATHER, local.ranks, piece)
            dist.all_gather_single(flat, piece, group=local.handle)
        if flat.data_ptr() != started.tensor.data_ptr():
            started.tensor.view(-1).copy_(flat[: started.tensor.numel()])
        return started.tensor

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group) -> torch.Tensor:
        """``tensor`` of global rank ``src``, in place on every rank of ``group``; each rank
        counts it once (the source sends it, the others receive it)."""
        if group.size == 1:
            return tensor
        self._count(Kind.BROADCAST, group.ranks, tensor)
        self._collective(dist.broadcast, tensor, group.handle, src=src)
        return tensor

    def all_gather(self, tensor: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
        """Every rank's ``tensor`` (all of one shape), concatenated along ``dim`` in the group's
        rank order: a new tensor. The ring brings the n - 1 other pieces in."""
        if group.size == 1:
            return tensor.clone()
        self._count(Kind.ALL_GATHER, group.ranks, tensor)
        piece = tensor.contiguous()
        if dim == 0:  # straight into one buffer, no concatenation
            whole = piece.new_empty((group.size * piece.shape[0], *piece.shape[1:]))
            dist.all_gather_single(whole, piece, group=group.handle)
            return whole
        pieces = [torch.empty_like(piece) for _ in range(group.size)]
        dist.all_gather(pieces, piece, group=group.handle)
        return torch.cat(pieces, dim=dim)

    def all_gather_into(self, whole: torch.Tensor, piece: torch.Tensor, group: Group) -> None:
        """Every rank's 1-D ``piece`` into the 1-D ``whole`` (the group's size times as long),
        in the group's rank order. ``piece`` may be this rank's own part of ``whole`` (the
        gather is then in place, as Megatron's distributed optimizer gathers its shards)."""
        if whole.numel() != group.size * piece.numel():
            raise ValueError(
                f"an all-gather of {piece.numel()} elements over {group.size} ranks fills "
                f"{group.size * piece.numel()}, not {whole.numel()}"
            )
        if group.size == 1:
            if piece.data_ptr() != whole.data_ptr():
                whole.copy_(piece)
            return
        self._count(Kind.ALL_GATHER, group.ranks, piece)
        dist.all_gather_single(whole, piece, group=group.handle)

    def start_all_reduce(self, tensor: torch.Tensor, group: Group) -> Pending:
        """Start summing ``tensor`` in place over ``group``, asynchronously: its result is the
        tensor. (Asynchronous collectives run among ranks of one vendor and device kind, whose
        native backend reads the tensors where they are.)"""
        self._count(Kind.ALL_REDUCE, group.ranks, tensor)
        return Pending(dist.all_reduce(tensor, group=group.handle, async_op=True), tensor)

    def start_all_gather_into(
        self, whole: torch.Tensor, piece: torch.Tensor, group: Group
    ) -> Pending:
        """``all_gather_into``, asynchronously: its result is ``whole``, which is not to be read
        before it is waited for. (Native, as ``start_all_reduce``.)"""
        if whole.numel() != group.size * piece.numel():
            raise ValueError(
                f"an all-gather of {piece.numel()} elements over {group.size} ranks fills "
                f"{group.size * piece.numel()}, not {whole.numel()}"
            )
        self._count(Kind.ALL_GATHER, group.ranks, piece)
        work = dist.all_gather_single(whole, piece, group=group.handle, async_op=True)
        return Pending(work, whole)

    def start_reduce_scatter(
        self, flat: torch.Tensor, group: Group, out: torch.Tensor | None = None
    ) -> Pending:
        """Start summing the 1-D ``flat`` (a multiple of the group's size long) over ``group``,
        asynchronously: its result is this rank's slice of the sum (rank i of the group: the
        i-th of size equal slices), in ``out`` where given (which may be that slice of
        ``flat`` itself: the sum is then in place), else in a new tensor."""
        if flat.numel() % group.size:
            raise ValueError(
                f"a reduce-scatter over {group.size} ranks needs a multiple of {group.size} "
                f"elements, not {flat.numel()}"
            )
        mine = flat.new_empty(flat.numel() // group.size) if out is None else out
        self._count(Kind.REDUCE_SCATTER, group.ranks, flat)
        work = dist.reduce_scatter_single(mine, flat, group=group.handle, async_op=True)
        return Pending(work, mine)

    # --- helpers -------------------------------------------------------------------------------

    def _count(self, kind: Kind, ranks: Sequence[int], tensor: torch.Tensor) -> None:
        """Count what this rank moves in a ``kind`` of transfer of ``tensor`` among ``ranks``
        (spec.collectives.moved_bytes: the ring factors) on the ranks' path."""
        if self._counting:
            nbytes = tensor.numel() * tensor.element_size()
            self.bytes[self.path(*ranks)] += moved_bytes(kind, nbytes, len(ranks))

    def _sliced_flat(
        self, tensor: torch.Tensor, local: Group, bridge: SlicedBridge
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``tensor`` flat for a sliced sum (a copy padded with zeros where the slices need
        whole elements, else a view: in place), and this rank's piece of it."""
        numel = tensor.numel()
        padded = padded_length(numel, bridge.parts)
        if padded == numel:
            flat = tensor.view(-1)
        else:
            flat = tensor.new_zeros(padded)
            flat[:numel].copy_(tensor.view(-1))
        size = padded // local.size
        index = local.ranks.index(self.rank)
        return flat, flat[index * size : (index + 1) * size]

    def _bridge_slices(self, flat: torch.Tensor, bridge: SlicedBridge) -> None:
        """Sum each slice of ``flat`` this rank owns with its owners on the other vendors, in
        place, all of them at once."""
        unit = flat.numel() // slice_units(bridge.parts)
        under_way = []
        for group, cut in zip(bridge.groups, bridge_slices(bridge.parts), strict=True):
            if self.rank in cut.ranks:
                part = flat[cut.start * unit : cut.stop * unit]
                self._count(Kind.ALL_REDUCE, group.ranks, part)
                under_way.append(self._start_bridged_all_reduce(part, group.handle))
        for finish in under_way:
            finish()

    def _ring_reduce_scatter(self, flat: torch.Tensor, group: Group) -> None:
        """Sum ``flat`` (a multiple of the group's size long) over ``group`` into this rank's
        piece of it (the i-th of size equal pieces for rank i of the group), in place: a ring
        of size - 1 sends of one piece each, each adding what arrives into the piece it then
        passes on."""
        size, me = group.size, group.ranks.index(self.rank)
        pieces = flat.chunk(size)
        right, left = group.ranks[(me + 1) % size], group.ranks[(me - 1) % size]
        arrived = torch.empty_like(pieces[0])
        for step in range(size - 1):
            sent = dist.isend(pieces[(me - step - 1) % size], right, group=group.handle)
            self.wait(dist.irecv(arrived, left, group=group.handle))
            self.wait(sent)
            pieces[(me - step - 2) % size].add_(arrived)

    def _ring_all_gather(self, flat: torch.Tensor, group: Group) -> None:
        """Every rank's piece of ``flat`` (as ``_ring_reduce_scatter`` left them) into the
        whole of it on every rank of ``group``: a ring of size - 1 sends of one piece each,
        each received in place."""
        size, me = group.size, group.ranks.index(self.rank)
        pieces = flat.chunk(size)
        right, left = group.ranks[(me + 1) % size], group.ranks[(me - 1) % size]
        for step in range(size - 1):
            sent = dist.isend(pieces[(me - step) % size], right, group=group.handle)
            self.wait(dist.irecv(pieces[(me - step - 1) % size], left, group=group.handle))
            self.wait(sent)

    def _collective(self, collective, tensor: torch.Tensor, handle, **kwargs) -> None:
        """Run ``collective`` on ``tensor`` in place, staged through host memory for gloo."""
        if not _needs_staging(tensor, handle):
            collective(tensor, group=handle, **kwargs)
            return
        host = self.staging.take(tensor.numel(), tensor.dtype).view(tensor.shape)
        host.copy_(tensor)  # the host needs the data now: this waits for the device
        collective(host, group=handle, **kwargs)
        self.staging.give_back(host, _copied_back(tensor, host))

    def _start_bridged_all_reduce(self, part: torch.Tensor, handle) -> Callable[[], None]:
        """Start summing the 1-D ``part`` in place over ``handle``; what finishes it. On an
        accelerator under gloo, in chunks of ``chunk_bytes`` through one pooled host
        buffer: the device copies every chunk to the host at once, each chunk's sum starts as
        soon as its copy lands, and its result goes back to the device as soon as it is done."""
        if not _needs_staging(part, handle):
            work = dist.all_reduce(part, group=handle, async_op=True)
            return work.wait
        host = self.staging.take(part.numel(), part.dtype)
        step = max(1, self.chunk_bytes // part.element_size())
        chunks = list(zip(part.split(step), host.split(step)))
        landed = []
        for device_chunk, host_chunk in chunks:
            host_chunk.copy_(device_chunk, non_blocking=True)
            landed.append(_event(part.device))
        works = []
        for arrived, (_, host_chunk) in zip(landed, chunks):
            arrived.synchronize()
            works.append(dist.all_reduce(host_chunk, group=handle, async_op=True))

        def finish() -> None:
            for work, (device_chunk, host_chunk) in zip(works, chunks):
                work.wait()
                device_chunk.copy_(host_chunk, non_blocking=True)
            self.staging.give_back(host, _event(part.device).query)

        return finish


def _needs_staging(tensor: torch.Tensor, handle) -> bool:
    """Whether ``tensor`` must go through host memory for the group's backend: an accelerator's
    tensor under gloo."""
    return tensor.device.type != "cpu" and dist.get_backend(handle) == "gloo"


def _event(device: torch.device) -> torch.Event:
    """An event recorded now on ``device``'s current stream: what was queued before it."""
    event = torch.Event(device=device)
    event.record()
    return event


def _copied_back(tensor: torch.Tensor, host: torch.Tensor) -> Callable[[], bool]:
    """Queue the copy of ``host`` back into the device's ``tensor`` (the host goes on); when
    the host buffer is free again."""
    tensor.copy_(host, non_blocking=True)
    return _event(tensor.device).query


def _handle(group: Group | None) -> dist.ProcessGroup | None:
    """torch's handle of ``group``; None (the world group) for None."""
    return group.handle if group is not None else None
