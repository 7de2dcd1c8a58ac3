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

Accumulation, without a Python call per parameter per micro-batch: in fp32 every weight's .grad
is its span of the main gradients, and autograd adds each micro-batch's gradient into it in
place. A bf16 weight cannot have an fp32 .grad, so its .grad is its span of a bf16 buffer, into
which autograd writes each micro-batch's gradient (onto zeros: exactly the gradient), and at the
end of each backward that chunk's bf16 gradients are added into the fp32 main gradients and
zeroed: a few foreach operations per backward, not a hook per parameter. The sum over the
micro-batches is taken in fp32 as before (Megatron's main_grad).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from hethub.runtime.flat_layout import FlatLayout
from hethub.runtime.model import StageChunks
from hethub.spec.plan import Precision

COMPUTE_DTYPE = {precision: getattr(torch, precision.dtype_name) for precision in Precision}
"""torch's dtype of each precision, named by Precision itself (the predictor's byte counts
read the same facts)."""


class _Piece(NamedTuple):
    """A run of one chunk's parameters, consecutive in the buffers and within one bucket: what
    the end of its backward adds from the bf16 gradients into the main ones."""

    bucket: int | None
    """Its bucket (None: parameters in no bucket)."""
    main: torch.Tensor
    """Its span of the main gradients."""
    grad: torch.Tensor
    """Its span of the bf16 gradients."""


class MasterWeights:
    """The trained parameters of ``stage`` under ``precision``, by full-model name: the stage's
    own in fp32; fp32 masters of its (then bf16) weights in bf16. Their main gradients start
    each step from ``zero_grad``."""

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
        # Left unwritten until zero_grad, before the first backward: their memory is first
        # touched then, as a model's gradients first appear in its first backward.
        self.main_grads = torch.empty(numel, device=device)
        """The fp32 main gradients, flat."""
        self.grads = torch.empty_like(self.flat) if bf16 else None
        """bf16: the bf16 weights' own gradients, flat: one backward's, zero between them."""
        self._final: set[int] = set()  # buckets whose main gradients are final this step
        self._move_into_buffers(named)
        if bf16:
            self.named = [(name, self._master_of(name, param)) for name, param in named]
            self._hook_flushes(stage)
        else:
            self.named = named
            for name, param in named:
                param.grad = self.grad(name)
        self.by_name = dict(self.named)

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
        """Before a step's first backward: every main gradient zero, in place."""
        self.main_grads.zero_()
        if self.grads is not None:
            self.grads.zero_()
        self._final.clear()

    def bucket_done(self, index: int) -> None:
        """Every gradient of bucket ``index`` has been given this step (its chunks' last
        backwards): bf16 adds its last ones into its main gradients now, and the flushes at the
        end of later backwards leave it alone, as an overlapped sync sums it meanwhile."""
        if self.grads is not None:
            grads = self.layout.bucket(self.grads, index)
            self.bucket_grads(index).add_(grads)
            grads.zero_()
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
        goes, so no moment holds the stage's weights twice, only one parameter of them."""
        with torch.no_grad():
            for start, stop in self.layout.padding():
                for flat in (self.flat, self.masters):
                    if flat is not None:
                        flat[start:stop].zero_()
            for name, param in named:
                if self.masters is not None:
                    self.layout.view(self.masters, name).copy_(param)
                view = self.layout.view(self.flat, name)
                view.copy_(param)
                param.data = view

    def _master_of(self, name: str, param: nn.Parameter) -> nn.Parameter:
        """bf16: parameter ``name``'s master, a view of the masters' buffer whose grad is its
        span of the main gradients; ``param``'s own grad is its span of the bf16 ones."""
        master = nn.Parameter(self.layout.view(self.masters, name))
        master.grad = self.grad(name)
        param.grad = self.layout.view(self.grads, name)
        return master

    def _hook_flushes(self, stage: nn.Module) -> None:
        """bf16: at the end of each backward of a chunk, add the chunk's bf16 gradients into
        the main gradients and zero them (``_flush``). Every parameter of a chunk takes a
        gradient in each of its backwards, so one parameter's hook, which runs once in each,
        queues the flush to run when the backward has given all of them."""
        chunks = list(stage.chunks) if isinstance(stage, StageChunks) else [stage]
        self._pieces = [self._pieces_of([n for n, _ in c.full_parameters()]) for c in chunks]
        for c, chunk in enumerate(chunks):
            _, first = chunk.full_parameters()[0]
            first.register_post_accumulate_grad_hook(self._flush_hook(c))

    def _pieces_of(self, names: list[str]) -> list[_Piece]:
        """The parameters ``names`` as runs of consecutive spans, each within one bucket."""
        bucket_of = {n: b for b, span in enumerate(self.layout.buckets) for n in span.names}
        runs: list[list] = []  # [bucket, start, stop]
        for name in sorted(names, key=lambda n: self.layout.spans[n]):
            start, stop = self.layout.spans[name]
            bucket = bucket_of.get(name)
            if runs and runs[-1][0] == bucket and runs[-1][2] == start:
                runs[-1][2] = stop
            else:
                runs.append([bucket, start, stop])
        return [_Piece(b, self.main_grads[lo:hi], self.grads[lo:hi]) for b, lo, hi in runs]

    def _flush_hook(self, chunk: int):
        def hook(_: torch.Tensor) -> None:
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._flush(chunk))

        return hook

    def _flush(self, chunk: int) -> None:
        """Add ``chunk``'s bf16 gradients of the backward just done into the main gradients
        (but those of buckets already final, which an overlapped sync may be summing), and zero
        them."""
        pieces = [p for p in self._pieces[chunk] if p.bucket not in self._final]
        if pieces:
            grads = [p.grad for p in pieces]
            torch._foreach_add_([p.main for p in pieces], grads)
            torch._foreach_zero_(grads)


def cpu_has_bf16_kernels() -> bool:
    """Whether torch multiplies bf16 matrices on this machine's CPU with kernels made for them:
    oneDNN's, which torch uses where the CPU has AVX-512 or AMX (x86) or the BF16 extension
    (Arm). Without them every bf16 matmul runs torch's reference loop, converting element by
    element, several times slower than fp32 (docs/runtime.md, "Precision", for this machine's
    figures)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        return False
