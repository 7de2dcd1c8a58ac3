"""A stage's saved-tensor inventory: one micro-batch's forward of a rank's stage, under the plan's
recomputation as runtime.pipeline runs it, and what autograd saves for its backward
(saved_tensors_hooks), each storage once, the stage's parameters and buffers left out (state,
not activations). The dry run measures each stage's activations so (runtime.dry_run).

Attention on the meta device: F.scaled_dot_product_attention has no fused kernel for meta
tensors and falls back to its math composite, which saves each head's fp32 (T, T) scores and
softmax, what no accelerator's fused kernel (nor the CPU's flash kernel) keeps. The forward
therefore runs each attention as the kernel spec.layer_ops names for the stage's device
(``_DeviceKernels``): aten._scaled_dot_product_flash_attention on an accelerator in bf16,
aten._scaled_dot_product_flash_attention_for_cpu otherwise (the CPU's kernel; also standing for
fp32's memory-efficient kernel, which keeps the same q, k, v, output and fp32 log-sum-exp).
Both have meta kernels and their autograd formulas save what the device's kernel saves.
Likewise RMSNorm: F.rms_norm (and aten._fused_rms_norm) decompose on meta into fp32 operations
that keep an fp32 copy of the input and the normalised input besides (6 bytes an element more in
bf16), where the fused kernel keeps the input and the fp32 rstd; the meta forward runs it as
runtime.model's _CpuRmsNorm, which keeps exactly those.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Self

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from hethub.errors import HethubError
from hethub.runtime.model import StageChunks, _CpuRmsNorm
from hethub.runtime.tensor_parallel import tp_size
from hethub.runtime.torch_support import private_aten_op, storage_key
from hethub.spec.model import ModelSpec
from hethub.spec.ops import Kernels
from hethub.spec.plan import Precision, Recompute


@dataclass(frozen=True, slots=True)
class SavedTensors:
    """What autograd saves for the backward of one micro-batch's forward of a stage, in bytes
    (saved_inventory): its activations, as its own tensors say."""

    layers: int
    """Saved up to the end of the stage's layers, over its chunks: the embedding's, the layers'
    (or, under full recomputation, each checkpointed layer's input). What stays in flight."""
    head: int = 0
    """Saved by the last stage's final norm and head, for the one micro-batch whose loss is
    under way: the predictor counts them in its buffers (its loss moments), not here."""
    rebuilt: int = 0
    """Full recomputation: what one layer saves when its backward runs it again, less its input
    (its checkpoint's, held already): the peak's one rebuilt layer."""

    def activations(self, in_flight: float) -> float:
        """The schedule's peak of activations, ``in_flight`` micro-batches of the stage held."""
        return in_flight * self.layers + self.rebuilt


class _DeviceKernels(TorchFunctionMode):
    """A meta forward's attention and RMSNorm saving what the device's kernels save (the
    module's docstring says why). F.scaled_dot_product_attention runs as ``kernel`` (an aten op
    of flash attention's signature): causal, no mask, no dropout, as runtime.model's layers call
    it; both kernels take k and v of fewer heads than q (grouped-query attention). F.rms_norm
    runs as runtime.model's _CpuRmsNorm, which keeps what the fused kernel keeps."""

    def __init__(self, kernel) -> None:
        super().__init__()
        self.kernel = kernel

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.rms_norm:
            x, weight, eps = _rms_norm_arguments(*args, **kwargs)
            return _CpuRmsNorm.apply(x, weight, eps)
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        if kwargs.get("attn_mask") is not None or kwargs.get("dropout_p"):
            raise HethubError(
                "the dry run's attention takes no mask and no dropout, as the stage's"
            )
        query, key, value = args[:3]
        causal = kwargs.get("is_causal", False)
        return self.kernel(query, key, value, 0.0, causal, scale=kwargs.get("scale"))[0]


def _rms_norm_arguments(input, normalized_shape, weight=None, eps=None):
    """F.rms_norm's arguments, however passed: runtime.model's norms pass a weight and an eps
    and normalise over the last dimension, as _CpuRmsNorm does."""
    return input, weight, eps


def attention_kernel(kernels: Kernels, precision: Precision):
    """The aten op spec.layer_ops names for a layer's attention on a device of ``kernels`` in
    ``precision``: flash attention on an accelerator in bf16, the CPU's flash kernel otherwise
    (fp32's memory-efficient kernel keeps what it keeps)."""
    if kernels is Kernels.FUSED and precision is not Precision.FP32:
        return private_aten_op("_scaled_dot_product_flash_attention")
    return private_aten_op("_scaled_dot_product_flash_attention_for_cpu")


def _storage_id(tensor: torch.Tensor) -> int:
    """Which storage ``tensor`` views: a view and its base are one allocation (meta tensors have
    no data pointer, but a storage each)."""
    return storage_key(tensor.untyped_storage())


class _Saved:
    """The storages autograd saves while it is entered (saved_tensors_hooks), each once, with
    its bytes and whether it was saved in the stage's head (``in_head`` at the time)."""

    def __init__(self) -> None:
        self.storages: dict[int, tuple[int, bool]] = {}
        self.in_head = False
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        self.storages.setdefault(storage_key(storage), (storage.nbytes(), self.in_head))
        return tensor  # kept by the graph: its storage's identity stays its own meanwhile

    def __enter__(self) -> Self:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def bytes(self, *, head: bool, leaving_out: set[int]) -> int:
        return sum(
            n
            for key, (n, in_head) in self.storages.items()
            if in_head == head and key not in leaving_out
        )


def saved_inventory(
    stage: StageChunks,
    inputs: Sequence[torch.Tensor],
    recompute: Recompute,
    kernels: Kernels,
    precision: Precision,
) -> SavedTensors:
    """One micro-batch's forward of each of ``stage``'s chunks (chunk c on ``inputs[c]``), under
    ``recompute`` as runtime.pipeline runs it, and the bytes autograd saves for its backward:
    each storage once (a tensor saved twice, or with its views, is one allocation), the stage's
    parameters and buffers left out (state, not activations). On the meta device the attention
    and RMSNorm run as the device's kernels (_DeviceKernels); on the CPU as torch dispatches
    them (runtime.model's RMSNorm is the fused kernel's already)."""
    meta = any(x.device.type == "meta" for x in inputs)

    def kernels_of_device():
        if not meta:
            return contextlib.nullcontext()
        return _DeviceKernels(attention_kernel(kernels, precision))

    saved = _Saved()
    first_input: list[torch.Tensor] = []

    def into_head(*_) -> None:
        saved.in_head = True

    def first_layer(_, args) -> None:
        if not first_input:
            first_input.append(args[0])

    hooks = [c.final_norm.register_forward_pre_hook(into_head) for c in stage.chunks if c.is_last]
    layers = [layer for c in stage.chunks for layer in c.layers.values()]
    if layers:
        hooks.append(layers[0].register_forward_pre_hook(first_layer))
    try:
        with saved, kernels_of_device():
            outputs = [chunk(x, recompute=recompute) for chunk, x in zip(stage.chunks, inputs)]
    finally:
        for hook in hooks:
            hook.remove()
    state = {_storage_id(t) for t in [*stage.parameters(), *stage.buffers()]}
    rebuilt = 0
    if recompute is Recompute.FULL and first_input:
        # A backward runs one layer again whole, keeping what it saves until that layer's
        # backward ends: what it saves then, less its input (its checkpoint's, held already).
        x = first_input[0].detach().requires_grad_()
        with _Saved() as again, kernels_of_device():
            rerun = layers[0](x)
        rebuilt = again.bytes(head=False, leaving_out=state | {_storage_id(x)})
        del rerun
    inventory = SavedTensors(
        layers=saved.bytes(head=False, leaving_out=state),
        head=saved.bytes(head=True, leaving_out=state),
        rebuilt=rebuilt,
    )
    del outputs
    return inventory


def stage_inputs(
    stage: StageChunks, model: ModelSpec, micro_batch: int, dtype: torch.dtype, device
) -> list[torch.Tensor]:
    """One micro-batch's input to each chunk, as runtime.pipeline hands them: token ids (B, T)
    to the model's first chunk, hidden states that take a gradient to the others, in the
    compute dtype: (B, T, h), or a sequence-parallel chunk's shard of them (B, T/t, h)."""
    inputs = []
    for chunk in stage.chunks:
        if chunk.is_first:
            inputs.append(
                torch.zeros((micro_batch, model.seq_len), dtype=torch.int64, device=device)
            )
            continue
        tokens = model.seq_len // (tp_size(chunk.group) if chunk.sequence_parallel else 1)
        hidden = torch.zeros((micro_batch, tokens, model.hidden), dtype=dtype, device=device)
        inputs.append(hidden.requires_grad_())
    return inputs
