"""Point-to-point and all-reduce between ranks, natively inside a vendor and over a host-staged
bridge across vendors, counting the bytes each path moves.

No collective library spans two vendors (NCCL cannot talk to HCCL), so traffic between groups of
different vendors is copied to host memory and sent over gloo, which every machine has; the
bytes count as the bridge's. Traffic between ranks of one vendor counts as native. Each message
and collective goes through the process group the caller gives it; a tensor on an accelerator
is staged through host memory when that group runs on gloo.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

NATIVE, BRIDGE = "native", "bridge"


class Communicator:
    """This rank's view: which path reaches which peer, and the bytes moved on each."""

    def __init__(self, vendors: Sequence[str], timeout: timedelta | None = None) -> None:
        """``vendors``: every rank's accelerator vendor, in rank order; ``timeout``: how long a
        message may take (None: forever). Collectives time out by their process group's
        timeout; a point-to-point wait in gloo does not, and would wait forever on a peer
        that stopped (SIGSTOP, a hung device) without dying."""
        self.rank = dist.get_rank()
        self.timeout = timeout
        self.vendor = list(vendors)
        self.bytes = {NATIVE: 0, BRIDGE: 0}

    def path(self, *ranks: int) -> str:
        """NATIVE when every rank is of one vendor, else BRIDGE."""
        return NATIVE if len({self.vendor[r] for r in ranks}) == 1 else BRIDGE

    def isend(self, tensor: torch.Tensor, peer: int, group=None):
        """Send ``tensor`` to global rank ``peer`` through ``group`` (None: the world group)."""
        self.bytes[self.path(self.rank, peer)] += tensor.numel() * tensor.element_size()
        return dist.isend(self._staged(tensor, group), peer, group=group)

    def recv(self, buffer: torch.Tensor, peer: int, group=None) -> torch.Tensor:
        """Receive into ``buffer`` from global rank ``peer`` through ``group`` (None: the world)."""
        staged = self._staged(buffer, group, copy=False)
        self.wait(dist.irecv(staged, peer, group=group))
        self.bytes[self.path(self.rank, peer)] += buffer.numel() * buffer.element_size()
        if staged is not buffer:  # queued on the device behind its work; the host goes on
            buffer.copy_(staged, non_blocking=True)
        return buffer

    def wait(self, work) -> None:
        """Wait for a point-to-point ``work`` within the timeout (RuntimeError past it)."""
        if self.timeout is None:
            work.wait()
        else:
            work.wait(self.timeout)

    def all_reduce(self, tensor: torch.Tensor, ranks: tuple[int, ...], group) -> torch.Tensor:
        """Sum ``tensor`` over ``ranks`` (this rank among them) through ``group``."""
        # A ring all-reduce moves 2 (n - 1) / n of the tensor out of every rank.
        self._counted(ranks, tensor, 2 * (len(ranks) - 1), len(ranks))
        self._collective(dist.all_reduce, tensor, group)
        return tensor

    def _counted(self, ranks: tuple[int, ...], tensor: torch.Tensor, parts: int, of: int) -> None:
        """Count ``parts`` / ``of`` of ``tensor``'s bytes as moved by this rank on the ranks'
        path (whole bytes, rounded down)."""
        self.bytes[self.path(*ranks)] += parts * tensor.numel() * tensor.element_size() // of

    def _collective(self, collective, tensor: torch.Tensor, group, **kwargs) -> None:
        """Run ``collective`` on ``tensor`` in place, staged through host memory for gloo."""
        staged = self._staged(tensor, group)
        collective(staged, group=group, **kwargs)
        if staged is not tensor:
            tensor.copy_(staged, non_blocking=True)

    def hierarchical_all_reduce(
        self,
        tensor: torch.Tensor,
        local: tuple[int, ...],
        local_group,
        bridge: tuple[int, ...],
        bridge_group,
    ) -> torch.Tensor:
        """Sum ``tensor`` over ranks of several vendors: reduce it to the first rank of this
        rank's vendor part (``local``, through its native ``local_group``), all-reduce among
        those first ranks (``bridge``, one per vendor, over the host-staged ``bridge_group``),
        broadcast the sum back inside the part. Only one copy per vendor crosses the bridge,
        where a flat ring over every rank would send 2 (n - 1) / n of it out of each."""
        first = local[0]
        if len(local) > 1:
            self._counted(local, tensor, len(local) - 1, len(local))
            self._collective(dist.reduce, tensor, local_group, dst=first)
        if self.rank == first:
            self.all_reduce(tensor, bridge, bridge_group)
        if len(local) > 1:
            self._counted(local, tensor, len(local) - 1, len(local))
            self._collective(dist.broadcast, tensor, local_group, src=first)
        return tensor

    def native(self, tensor: torch.Tensor, factor: float = 1.0) -> None:
        """Count bytes a native collective inside a TP group moved."""
        self.bytes[NATIVE] += int(factor * tensor.numel() * tensor.element_size())

    @staticmethod
    def _staged(tensor: torch.Tensor, group, *, copy: bool = True) -> torch.Tensor:
        """``tensor`` where ``group``'s backend can read it: the tensor itself for a native
        backend (or a CPU tensor), else a copy in pinned host memory for gloo, which the device
        copies at full speed, and from which a received result goes back without blocking."""
        if tensor.device.type == "cpu" or dist.get_backend(group) != "gloo":
            return tensor
        staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        if copy:  # the host needs the data now: this waits for the device (not for a receive)
            staged.copy_(tensor)
        return staged
