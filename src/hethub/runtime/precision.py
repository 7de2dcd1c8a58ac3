"""Training precision on one stage: fp32 throughout, or bf16 mixed precision as Megatron-LM runs
it; and where a rank's weights and gradients live.

bf16: the stage's weights, activations and matmuls are bf16 (the messages between stages too);
each weight's gradient is accumulated over the micro-batches into an fp32 "main grad"; the fp32
master weights hold the truth, AdamW steps them in fp32, and the bf16 weights are copied from
them after each step; the loss is computed in fp32. What the gradient sync, the optimizer and
checkpoints see are the master weights and their fp32 grads, so they work alike in both
precisions.

Buffers (runtime.flat_layout): the weights the stage computes with, their fp32 main gradients
and bf16's fp32 masters are each one flat buffer of the rank, made once and kept; every
parameter, its master and their grads are views of them. So the gradient sync sums a bucket in
place, a sharded optimizer steps its shard of the weights in place, and bf16's copy back is one
copy.

Accumulation, without a Python call per parameter per micro-batch and without zeroing the main
gradients: each backward's gradients are autograd's own tensors, as a plain trainer's (the
weights have no .grad when it starts, so autograd hands each one its new gradient, no copy nor
add), and at the end of each backward of a chunk one foreach operation moves them into the fp32
main gradients: a copy (with bf16's cast) at the chunk's first backward of the step, an add at
the later ones. bf16 does so at every backward, then drops them (Megatron's main_grad: the sum
over the micro-batches is taken in fp32). fp32 makes each weight's .grad its span of the main
gradients after the first, so that autograd adds the later micro-batches' in place, as torch's
own accumulation does, keeping no second copy of the gradients. So a step of one micro-batch
moves its gradients once, as a plain trainer's cast to its fp32 masters does, and never zeroes
a buffer. An overlapped sync moves a bucket's as soon as they are final (``bucket_done``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from hethub.runtime.flat_layout import FlatLayout
from hethub.runtime.model import StageChunks
from hethub.runtime.torch_support import (
    foreach_add_,
    foreach_copy_,
    foreach_zero_,
    mkldnn_bf16_supported,
    queue_backward_callback,
)
from hethub.spec.plan import Precision

COMPUTE_DTYPE = {precision: getattr(torch, precision.dtype_name) for precision in Precision}
"""torch's dtype of each precision, named by Precision itself (the predictor's byte counts
read the same facts)."""


class _Slot(NamedTuple):
    """A weight the stage computes with, where its gradient goes."""

    param: nn.Parameter
    """The weight (bf16 in bf16), whose .grad autograd gives each backward's gradient."""
    main: torch.Tensor
    """Its span of the main gradients."""
    bucket: int | None
    """Its gradient sync bucket (None: in no bucket)."""


class MasterWeights:
    """The trained parameters of ``stage`` under ``precision``, by full-model name: the stage's
    own in fp32; fp32 masters of its (then bf16) weights in bf16. Their main gradients start
    each step afresh from ``zero_grad``."""

    def __init__(
        self,
        stage: nn.Module,
        precision: Precision,
        buckets: Sequence[Sequence[str]] = (),
        shards: int = 1,
    ) -> None:
        """``buckets`` and ``shards``: the gradient sync's buckets and a sharded optimizer's
        shards, which lay out the buffers (FlatLayout)."""
        self.stage, self.precision = stage, Precision(precision)
        named = stage.full_parameters()
        self.model = dict(named)
        self.layout = FlatLayout({name: p.shape for name, p in named}, buckets, shards)
        device, numel = named[0][1].device, self.layout.numel
        bf16 = self.precision.master_weights
        self.flat = torch.empty(numel, dtype=self.compute_dtype, device=device)
        """The weights the stage computes with, flat (a bucket's padding zero)."""
        self.masters = torch.empty(numel, device=device) if bf16 else None
        """bf16: the fp32 master weights, flat (None once a sharded optimizer has taken its
        shards of them); fp32: None, the weights are their own masters."""
        # Written by the first backward (its gradients are copied in, not added): their memory
        # is first touched then, as a model's gradients first appear in its first backward.
        # Only the padding, which no gradient covers, is zeroed here, once.
        self.main_grads = torch.empty(numel, device=device)
        """The fp32 main gradients, flat."""
        self._move_into_buffers(named)
        if bf16:
            self.named = [(name, self._master_of(name)) for name, _ in named]
        else:
            self.named = named
        self.by_name = dict(self.named)
        self._slots = self._slots_of(stage)  # per chunk
        self._taken = [False] * len(self._slots)  # chunks whose gradients the step has taken
        self._final: set[int] = set()  # buckets whose main gradients are final this step
        self._hook_flushes(stage)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the stage's activations and of the messages between stages."""
        return COMPUTE_DTYPE[self.precision]

    @property
    def fp32_flat(self) -> torch.Tensor:
        """The fp32 weights the optimizer steps, flat: the masters in bf16, the weights
        themselves in fp32."""
        return self.flat if self.masters is None else self.masters

    def parameters(self) -> list[nn.Parameter]:
        """What an optimizer of whole parameters steps (their grads: the main gradients)."""
        return [param for _, param in self.named]

    def grad(self, name: str) -> torch.Tensor:
        """Parameter ``name``'s main gradient (a view of the flat buffer)."""
        return self.layout.view(self.main_grads, name)

    def bucket_grads(self, index: int, *, padded: bool = False) -> torch.Tensor:
        """Bucket ``index``'s main gradients, flat (a view of the buffer)."""
        return self.layout.bucket(self.main_grads, index, padded=padded)

    def master_bytes(self) -> int:
        """Bytes of fp32 master weights kept for the optimizer (bf16 only)."""
        return 0 if self.masters is None else self.masters.nbytes

    def zero_grad(self) -> None:
        """Before a step's first backward: the step's gradients start afresh. Nothing is
        written: each chunk's first backward copies its gradients into the main gradients (a
        parameter it gives none, zeros), and until then they hold the last step's."""
        self.stage.zero_grad(set_to_none=True)  # autograd hands over the first backward's
        self._taken = [False] * len(self._slots)
        self._final.clear()

    def bucket_done(self, index: int) -> None:
        """Every gradient of bucket ``index`` has been given this step (its chunks' last
        backwards): those not yet in the main gradients go there now, and the flushes at the
        end of later backwards leave the bucket alone, as an overlapped sync sums it
        meanwhile."""
        for chunk, slots in enumerate(self._slots):
            self._take(chunk, [s for s in slots if s.bucket == index])
        self._final.add(index)

    def release_masters(self) -> None:
        """bf16: drop the masters' values (a sharded optimizer keeps its slices of them); each
        master stays the holder of its fp32 main gradient, its value a broadcast zero that takes
        no memory. The stage's weights are then written by ``write``."""
        if self.masters is None:
            return
        for _, master in self.named:
            master.data = master.data.new_zeros(()).expand(master.shape)
        self.masters = None

    def write(self, name: str, value: torch.Tensor) -> None:
        """Set parameter ``name`` (its TP shard on this rank) to ``value`` (fp32, or already in
        the stage's dtype): the weight the stage computes with, and its master where one is
        kept."""
        with torch.no_grad():
            self.model[name].copy_(value)
            if self.masters is not None:
                self.layout.view(self.masters, name).copy_(value)

    def copy_to_model(self) -> None:
        """After an optimizer step (or a checkpoint load): the stage computes with the masters'
        new values (one copy of the flat buffer)."""
        if self.masters is not None:
            self.flat.copy_(self.masters)

    def _move_into_buffers(self, named: list[tuple[str, nn.Parameter]]) -> None:
        """Each parameter becomes a view of the weights' buffer, its value copied there (and to
        the masters'). One at a time, into buffers made empty: each leaves its own memory as it
        goes, so no moment holds the stage's weights twice, only one parameter of them. Every
        buffer's padding is zeroed (a sharded optimizer steps and gathers it)."""
        with torch.no_grad():
            for start, stop in self.layout.padding():
                for flat in (self.flat, self.masters, self.main_grads):
                    if flat is not None:
                        flat[start:stop].zero_()
            for name, param in named:
                if self.masters is not None:
                    self.layout.view(self.masters, name).copy_(param)
                view = self.layout.view(self.flat, name)
                view.copy_(param)
                param.data = view

    def _master_of(self, name: str) -> nn.Parameter:
        """bf16: parameter ``name``'s master, a view of the masters' buffer whose grad is its
        span of the main gradients."""
        master = nn.Parameter(self.layout.view(self.masters, name))
        master.grad = self.grad(name)
        return master

    def _slots_of(self, stage: nn.Module) -> list[list[_Slot]]:
        """Per chunk, its weights and where their gradients go."""
        chunks = list(stage.chunks) if isinstance(stage, StageChunks) else [stage]
        bucket_of = {n: b for b, span in enumerate(self.layout.buckets) for n in span.names}
        return [
            [
                _Slot(param, self.grad(name), bucket_of.get(name))
                for name, param in chunk.full_parameters()
            ]
            for chunk in chunks
        ]

    def _hook_flushes(self, stage: nn.Module) -> None:
        """At the end of each backward of a chunk, move its gradients into the main gradients
        (``_flush``). Every parameter of a chunk takes a gradient in each of its backwards, so
        one parameter's hook, which runs once in each, queues the flush to run when the
        backward has given all of them."""
        self._hooks = [
            slots[0].param.register_post_accumulate_grad_hook(self._flush_hook(c))
            for c, slots in enumerate(self._slots)
        ]

    def remove_hooks(self) -> None:
        """Take the flush hooks off the stage's parameters. Each hook holds this object, which
        holds the parameters: a loop through torch's C++ tensor that Python's collector never
        finds, so a stage built and dropped (the dry run builds one per rank) would stay."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _flush_hook(self, chunk: int):
        def hook(_: torch.Tensor) -> None:
            queue_backward_callback(lambda: self._flush(chunk))

        return hook

    def _flush(self, chunk: int) -> None:
        """After a backward of ``chunk``: its gradients into the main gradients (but those of
        buckets already final, which an overlapped sync may be summing)."""
        slots = self._slots[chunk]
        if self._final:
            slots = [s for s in slots if s.bucket not in self._final]
        self._take(chunk, slots)
        self._taken[chunk] = True

    def _take(self, chunk: int, slots: list[_Slot]) -> None:
        """The gradients the backward just done gave ``slots`` (of ``chunk``) into their main
        gradients, in one foreach operation: copied at the chunk's first backward of the step
        (a parameter given none gets zeros), added at the later ones. bf16 then drops them;
        fp32 makes each .grad its main gradient, into which autograd adds the later ones."""
        first, bf16 = not self._taken[chunk], self.precision.master_weights
        if not (first or bf16) or not slots:
            return  # fp32 after the first: autograd has added them in place
        given = [s for s in slots if s.param.grad is not None]
        if given:
            move = foreach_copy_ if first else foreach_add_
            move([s.main for s in given], [s.param.grad for s in given])
        if first and len(given) < len(slots):
            foreach_zero_([s.main for s in slots if s.param.grad is None])
        for s in slots:
            s.param.grad = None if bf16 else s.main


def cpu_has_bf16_kernels() -> bool:
    """Whether torch multiplies bf16 matrices on this machine's CPU with kernels made for them:
    oneDNN's, which torch uses where the CPU has AVX-512 or AMX (x86) or the BF16 extension
    (Arm). Without them every bf16 matmul runs torch's reference loop, converting element by
    element, several times slower than fp32 (docs/runtime.md, "Precision", for this machine's
    figures)."""
    try:
        return mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        return False
