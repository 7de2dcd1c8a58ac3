"""Every message and collective between ranks, natively inside a vendor and over a host-staged
bridge across vendors, each counting the bytes it moves on its path.

No collective library spans two vendors (NCCL cannot talk to HCCL), so traffic between groups of
different vendors is copied to host memory and sent over gloo, which every machine has; the
bytes count as the bridge's. Traffic between ranks of one vendor counts as native. Each message
and collective goes through the group (comm.Group) the caller gives it; a tensor on an
accelerator is staged through host memory when that group runs on gloo.

A method both runs its collective and counts what it moves out of this rank, so the ring
factors live here and nowhere else: an all-reduce moves 2 (n - 1) / n of its tensor, a
reduce-scatter (n - 1) / n of its input, an all-gather (n - 1) / n of its output, a broadcast
the tensor once on every rank. Bookkeeping outside the training traffic (the step's loss
report, a checkpoint's gathers) runs under ``not_counted``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from hethub.comm.group import Group

NATIVE, BRIDGE = "native", "bridge"

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


class Communicator:
    """This rank's view: which path reaches which peer, and the bytes moved on each."""

    def __init__(self, vendors: Sequence[str], timeout: timedelta | None = None) -> None:
        """``vendors``: every rank's accelerator vendor, in rank order; ``timeout``: how long a
        message may take (None: forever). Collectives time out by their process group's
        timeout; a point-to-point wait in gloo does not, and would wait forever on a peer
        that stopped (SIGSTOP, a hung device) without dying."""
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.timeout = timeout
        self.vendor = list(vendors)
        self.bytes = {NATIVE: 0, BRIDGE: 0}
        self._counting = True

    def path(self, *ranks: int) -> str:
        """NATIVE when every rank is of one vendor, else BRIDGE."""
        return NATIVE if len({self.vendor[r] for r in ranks}) == 1 else BRIDGE

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

    def isend(self, tensor: torch.Tensor, peer: int, group: Group | None = None) -> Work:
        """Start sending ``tensor`` to global rank ``peer`` through ``group`` (None: the world
        group); ``wait`` for the work before the tensor changes."""
        self._count((self.rank, peer), tensor)
        handle = _handle(group)
        return dist.isend(self._staged(tensor, handle), peer, group=handle)

    def recv(self, buffer: torch.Tensor, peer: int, group: Group | None = None) -> torch.Tensor:
        """Receive into ``buffer`` from global rank ``peer`` through ``group`` (None: the world)."""
        handle = _handle(group)
        staged = self._staged(buffer, handle, copy=False)
        self.wait(dist.irecv(staged, peer, group=handle))
        self._count((self.rank, peer), buffer)
        if staged is not buffer:  # queued on the device behind its work; the host goes on
            buffer.copy_(staged, non_blocking=True)
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
        self._count(group.ranks, tensor, 2 * (group.size - 1), group.size)  # a ring
        self._collective(dist.all_reduce, tensor, group.handle)
        return tensor

    def hierarchical_all_reduce(
        self, tensor: torch.Tensor, local: Group, bridge: Group
    ) -> torch.Tensor:
        """Sum ``tensor`` in place over ranks of several vendors: reduce it to the first rank
        of this rank's vendor part (``local``, natively), all-reduce among those first ranks
        (``bridge``, one per vendor, host-staged), broadcast the sum back inside the part. Only
        one copy per vendor crosses the bridge, where a flat ring over every rank would send
        2 (n - 1) / n of it out of each."""
        if local.size > 1:
            self._count(local.ranks, tensor, local.size - 1, local.size)
            self._collective(dist.reduce, tensor, local.handle, dst=local.ranks[0])
        return self.finish_hierarchical_all_reduce(tensor, local, bridge)

    def start_hierarchical_all_reduce(self, tensor: torch.Tensor, local: Group) -> Pending | None:
        """Start the part of ``hierarchical_all_reduce`` that stays inside this rank's vendor,
        asynchronously: the reduce to the first rank of ``local`` (None where ``local`` is
        this rank alone: nothing to reduce). ``finish_hierarchical_all_reduce`` does the rest
        once it is waited for. (Native, as ``start_all_reduce``.)"""
        if local.size == 1:
            return None
        self._count(local.ranks, tensor, local.size - 1, local.size)
        work = dist.reduce(tensor, local.ranks[0], group=local.handle, async_op=True)
        return Pending(work, tensor)

    def finish_hierarchical_all_reduce(
        self, tensor: torch.Tensor, local: Group, bridge: Group
    ) -> torch.Tensor:
        """The rest of ``hierarchical_all_reduce`` once ``tensor`` is reduced to the first rank
        of ``local``: the exchange among the vendors' first ranks (``bridge``), then the
        broadcast of the sum inside the vendor."""
        first = local.ranks[0]
        if self.rank == first:
            self.all_reduce(tensor, bridge)
        if local.size > 1:
            self._count(local.ranks, tensor, local.size - 1, local.size)
            self._collective(dist.broadcast, tensor, local.handle, src=first)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group) -> torch.Tensor:
        """``tensor`` of global rank ``src``, in place on every rank of ``group``; each rank
        counts it once (the source sends it, the others receive it)."""
        if group.size == 1:
            return tensor
        self._count(group.ranks, tensor)
        self._collective(dist.broadcast, tensor, group.handle, src=src)
        return tensor

    def all_gather(self, tensor: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
        """Every rank's ``tensor`` (all of one shape), concatenated along ``dim`` in the group's
        rank order: a new tensor. The ring brings the n - 1 other pieces in."""
        if group.size == 1:
            return tensor.clone()
        self._count(group.ranks, tensor, group.size - 1)
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
        self._count(group.ranks, piece, group.size - 1)
        dist.all_gather_single(whole, piece, group=group.handle)

    def start_all_reduce(self, tensor: torch.Tensor, group: Group) -> Pending:
        """Start summing ``tensor`` in place over ``group``, asynchronously: its result is the
        tensor. (Asynchronous collectives run among ranks of one vendor and device kind, whose
        native backend reads the tensors where they are.)"""
        self._count(group.ranks, tensor, 2 * (group.size - 1), group.size)
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
        self._count(group.ranks, piece, group.size - 1)
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
        self._count(group.ranks, flat, group.size - 1, group.size)
        work = dist.reduce_scatter_single(mine, flat, group=group.handle, async_op=True)
        return Pending(work, mine)

    # --- helpers -------------------------------------------------------------------------------

    def _count(
        self, ranks: Sequence[int], tensor: torch.Tensor, parts: int = 1, of: int = 1
    ) -> None:
        """Count ``parts`` / ``of`` of ``tensor``'s bytes as moved by this rank on the ranks'
        path (whole bytes, rounded down)."""
        if self._counting:
            self.bytes[self.path(*ranks)] += parts * tensor.numel() * tensor.element_size() // of

    def _collective(self, collective, tensor: torch.Tensor, handle, **kwargs) -> None:
        """Run ``collective`` on ``tensor`` in place, staged through host memory for gloo."""
        staged = self._staged(tensor, handle)
        collective(staged, group=handle, **kwargs)
        if staged is not tensor:
            tensor.copy_(staged, non_blocking=True)

    @staticmethod
    def _staged(tensor: torch.Tensor, handle, *, copy: bool = True) -> torch.Tensor:
        """``tensor`` where the group's backend can read it: the tensor itself for a native
        backend (or a CPU tensor), else a copy in pinned host memory for gloo, which the device
        copies at full speed, and from which a received result goes back without blocking."""
        if tensor.device.type == "cpu" or dist.get_backend(handle) != "gloo":
            return tensor
        staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        if copy:  # the host needs the data now: this waits for the device (not for a receive)
            staged.copy_(tensor)
        return staged


def _handle(group: Group | None) -> dist.ProcessGroup | None:
    """torch's handle of ``group``; None (the world group) for None."""
    return group.handle if group is not None else None
