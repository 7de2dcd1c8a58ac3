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

import torch
import torch.distributed as dist

NATIVE, BRIDGE = "native", "bridge"


class Communicator:
    """This rank's view: which path reaches which peer, and the bytes moved on each."""

    def __init__(self, vendors: Sequence[str]) -> None:
        """``vendors``: every rank's accelerator vendor, in rank order."""
        self.rank = dist.get_rank()
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
        staged = self._staged(buffer, group)
        dist.recv(staged, peer, group=group)
        self.bytes[self.path(self.rank, peer)] += buffer.numel() * buffer.element_size()
        if staged is not buffer:
            buffer.copy_(staged)
        return buffer

    def all_reduce(self, tensor: torch.Tensor, ranks: tuple[int, ...], group) -> torch.Tensor:
        """Sum ``tensor`` over ``ranks`` (this rank among them) through ``group``."""
        # A ring all-reduce moves 2 (n - 1) / n of the tensor out of every rank.
        self.bytes[self.path(*ranks)] += (
            2 * (len(ranks) - 1) * tensor.numel() * tensor.element_size() // len(ranks)
        )
        staged = self._staged(tensor, group)
        dist.all_reduce(staged, group=group)
        if staged is not tensor:
            tensor.copy_(staged)
        return tensor

    def native(self, tensor: torch.Tensor, factor: float = 1.0) -> None:
        """Count bytes a native collective inside a TP group moved."""
        self.bytes[NATIVE] += int(factor * tensor.numel() * tensor.element_size())

    @staticmethod
    def _staged(tensor: torch.Tensor, group) -> torch.Tensor:
        """``tensor`` where ``group``'s backend can read it: a copy in host memory for gloo (a
        CPU tensor is there already), the tensor itself for a native backend."""
        if tensor.device.type == "cpu" or dist.get_backend(group) != "gloo":
            return tensor
        return tensor.cpu()
