"""What a stretch of code asks of the device: the operators torch dispatches (each a kernel
launch or more on an accelerator), by name, and the host reads among them. Counted on any device,
the CPU too: the operations are the same everywhere, only their speed differs. The benchmarks
that compare hethub's step or layer with a plain torch one (single_device, layer_kernels,
step_op_counts) and the tests that hold them to a budget count with this.
"""

from __future__ import annotations

import collections

import torch

from hethub.runtime.torch_support import dispatch_mode_class, private_aten_op

aten = torch.ops.aten
NO_KERNEL = frozenset({"_unsafe_view"})
"""Not a view to the dispatcher, but an alias all the same: it launches nothing."""
TO_COPY = private_aten_op("_to_copy").default
"""A copy to another dtype or device (.to): a host read where it copies to the CPU."""
HOST_SYNCING = {
    private_aten_op("_local_scalar_dense").default,
    aten.nonzero.default,
    aten.masked_select.default,
}
"""Operators whose result the host must wait for: a scalar read (item, bool, float) and the
operators whose output's shape depends on the data."""


class OpCounter(dispatch_mode_class()):
    """Counts the operators dispatched while it is active: ``ops``, by name, those that launch
    work (views and aliases aside), and ``host_reads``, the names of those that make the host
    wait for data on ``device`` (reads_to_host)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.device = torch.device(device)
        self.ops: collections.Counter[str] = collections.Counter()
        self.host_reads: list[str] = []

    @property
    def total(self) -> int:
        """Every operation counted."""
        return sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if not func.is_view and name not in NO_KERNEL:
            self.ops[name] += 1
        if reads_to_host(func, args, kwargs, self.device):
            self.host_reads.append(str(func))
        return func(*args, **kwargs)


def reads_to_host(func, args: tuple, kwargs: dict, device: torch.device) -> bool:
    """Whether the operator makes the host wait for data on ``device``: a host-syncing operator
    on it, or a copy from it to the CPU. Where the device is the CPU itself, every tensor is on
    it (AdamW's step counters too, which an accelerator's run keeps on the host), and a copy to
    the CPU counts where it keeps the dtype (a transfer such as ``.to("cpu", copy=True)``, not
    a cast, which names the device too); a read that dispatches nothing there (``tolist`` of a
    CPU tensor) is seen only on an accelerator."""
    if func in HOST_SYNCING:
        return args[0].device.type == device.type
    if func is TO_COPY:
        target, source = kwargs.get("device"), args[0]
        if target is None or torch.device(target).type != "cpu":
            return False
        if device.type == "cpu":
            return kwargs.get("dtype", source.dtype) == source.dtype
        return source.device.type == device.type
    if func is aten.copy_.default:
        return args[0].device.type == "cpu" and args[1].device.type == device.type != "cpu"
    return False
