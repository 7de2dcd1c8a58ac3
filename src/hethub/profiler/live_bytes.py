"""The bytes of tensors a process holds, at their peak over a stretch of code: what a stage's
memory really is, for the predictor's memory to be checked against (benchmarks/
memory_vs_runtime.py).

Every storage alive when counting starts is counted (weights, gradients, optimizer state), and
every storage an operation makes below autograd while counting (a TorchDispatchMode sees each
operation's outputs, in the forward and the backward alike) until torch frees it (a weak
reference to the storage, whose Python object torch keeps as long as the storage lives). Views
share their base's storage and count once. What no operation returns (a kernel's scratch space,
gloo's buffers) is not counted.
"""

from __future__ import annotations

import gc
import weakref
from typing import Self

import torch

from hethub.runtime.torch_support import dispatch_mode_class, tree_leaves


class LiveBytes(dispatch_mode_class()):
    """``with LiveBytes() as live: ...``: ``live.peak`` bytes at once, ``live.current`` now."""

    def __init__(self) -> None:
        super().__init__()
        self._sizes: dict[int, int] = {}  # id of a live storage -> its bytes
        self.current = self.peak = 0

    def __enter__(self) -> Self:
        gc.collect()  # what is garbage already is not held
        for obj in gc.get_objects():
            # type(), not isinstance: some objects' __class__ warns (torch.distributed.reduce_op)
            if issubclass(type(obj), torch.Tensor):
                self.count(obj)
        self.peak = self.current
        return super().__enter__()

    def count(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage until torch frees it (once, however many views)."""
        if tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._sizes:
            return
        self._sizes[key] = storage.nbytes()
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        self.current -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.count(leaf)
        return out
