"""The sharded optimizer's weight all-gather overlapped with the next step's forwards (a plan's
``overlap_param_gather``; Megatron-LM's ``overlap_param_gather``).

After its step the sharded optimizer (runtime.optimizer.ShardedAdamW) leaves each bucket's
all-gather under way. Each module of the stage then waits, in a forward pre-hook, for the buckets
holding its own parameters just before its first forward of the step: the first micro-batch's
forward through the embedding and the first layers runs while the later layers' weights are
still arriving. The hooks are set for the first forwards of the step alone (no Python call in
the others) and removed when the step's schedule is over.

A module waits for every bucket holding one of its parameters, whatever the bucket holds
besides; a compiled layer (runtime.compiled) is waited for by its chunk's hook instead, before
the chunk's forward, as a hook inside it would break its graph.
"""

from __future__ import annotations

from torch import nn
from torch.utils.hooks import RemovableHandle

from hethub.runtime.model import StageChunks
from hethub.runtime.optimizer import ShardedAdamW


class ForwardWaits:
    """Forward pre-hooks that wait for the optimizer's all-gathers of the weights they read."""

    def __init__(self, stage: StageChunks, optimizer: ShardedAdamW) -> None:
        """``stage``: this rank's chunks, whose weights ``optimizer`` gathers."""
        self.optimizer = optimizer
        bucket_of = {
            name: b
            for b, span in enumerate(optimizer.weights.layout.buckets)
            for name in span.names
        }
        self._waits: list[tuple[nn.Module, tuple[int, ...]]] = []  # (module, its buckets)
        for chunk in stage.chunks:
            waited_by_chunk = [name for name, _ in chunk.named_parameters(recurse=False)]
            for module_name, module in _forwarded_children(chunk):
                names = [f"{module_name}.{n}" for n, _ in module.named_parameters()]
                if _compiled(module):
                    waited_by_chunk += names
                else:
                    self._waits.append((module, _buckets(chunk, names, bucket_of)))
            self._waits.insert(0, (chunk, _buckets(chunk, waited_by_chunk, bucket_of)))
        self._armed: list[RemovableHandle] = []

    def arm(self) -> None:
        """After the optimizer's step: each module waits for its buckets before its forward."""
        self.disarm()
        for module, buckets in self._waits:
            if buckets:
                self._armed.append(module.register_forward_pre_hook(self._hook(buckets)))

    def disarm(self) -> None:
        """Remove the hooks (every bucket waited for, or to be waited for by other means)."""
        for handle in self._armed:
            handle.remove()
        self._armed.clear()

    def _hook(self, buckets: tuple[int, ...]):
        def hook(_module: nn.Module, _args) -> None:
            for bucket in buckets:
                self.optimizer.wait_gather(bucket)

        return hook


def _forwarded_children(chunk: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules a chunk's forward calls, by their name in the chunk: its children, and each
    transformer layer of its layer dictionary (which is never called itself)."""
    out = []
    for name, child in chunk.named_children():
        if isinstance(child, nn.ModuleDict):
            out += [(f"{name}.{key}", layer) for key, layer in child.items()]
        else:
            out.append((name, child))
    return out


def _buckets(chunk, names: list[str], bucket_of: dict[str, int]) -> tuple[int, ...]:
    """The buckets holding the chunk's parameters ``names`` (its own names), in bucket order."""
    return tuple(sorted({bucket_of[chunk.full_name(n)] for n in names}))


def _compiled(module: nn.Module) -> bool:
    """Whether ``module`` runs compiled (nn.Module.compile), so that a hook would be traced."""
    return getattr(module, "_compiled_call_impl", None) is not None
