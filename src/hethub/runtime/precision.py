"""Training precision on one stage: fp32 throughout, or bf16 mixed precision as Megatron-LM runs
it.

bf16: the stage's weights, activations and matmuls are bf16 (the messages between stages too);
each weight's gradient is accumulated over the micro-batches into an fp32 "main grad" as soon as
its backward produces it; the fp32 master weights hold the truth, AdamW steps them in fp32, and
the bf16 weights are copied from them after each step; the loss is computed in fp32. What the
gradient sync, the optimizer and checkpoints see are the master weights and their fp32 grads, so
they work alike in both precisions.
"""

from __future__ import annotations

import torch
from torch import nn

from hethub.spec.plan import Precision

COMPUTE_DTYPE = {precision: getattr(torch, precision.dtype_name) for precision in Precision}
"""torch's dtype of each precision, named by Precision itself (the predictor's byte counts
read the same facts)."""


class MasterWeights:
    """The trained parameters of ``stage`` under ``precision``, by full-model name: the stage's
    own in fp32; fp32 masters of its (then bf16) weights in bf16."""

    def __init__(self, stage: nn.Module, precision: Precision) -> None:
        self.stage, self.precision = stage, Precision(precision)
        named = stage.full_parameters()
        self.model = dict(named)
        self.released = False
        if self.precision is Precision.FP32:
            self.named = named
            self.by_name = self.model
            return
        self.named = []
        for name, param in named:
            # One parameter at a time: the fp32 value becomes the master, the stage keeps a bf16
            # copy, so no moment holds two fp32 copies of the stage.
            master = nn.Parameter(param.detach().float().clone())
            param.data = param.data.to(COMPUTE_DTYPE[self.precision])
            param.register_post_accumulate_grad_hook(_accumulate_into(master))
            self.named.append((name, master))
        self.by_name = dict(self.named)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the stage's activations and of the messages between stages."""
        return COMPUTE_DTYPE[self.precision]

    def parameters(self) -> list[nn.Parameter]:
        """What the optimizer steps."""
        return [param for _, param in self.named]

    def master_bytes(self) -> int:
        """Bytes of fp32 master weights kept for the optimizer (bf16 only)."""
        if self.precision is Precision.FP32 or self.released:
            return 0
        return sum(param.nbytes for _, param in self.named)

    def release_masters(self) -> None:
        """bf16: drop the masters' values (a sharded optimizer keeps its slices of them); each
        master stays the holder of its fp32 main gradient, its value a broadcast zero that takes
        no memory. The stage's weights are then written by ``write``."""
        if self.precision is Precision.FP32:
            return
        for _, master in self.named:
            master.data = master.data.new_zeros(()).expand(master.shape)
        self.released = True

    def write(self, name: str, value: torch.Tensor) -> None:
        """Set parameter ``name`` (its TP shard on this rank) to ``value`` (fp32, or already in
        the stage's dtype): the weight the stage computes with, and its master where one is
        kept."""
        with torch.no_grad():
            self.model[name].copy_(value)
            if self.precision is Precision.BF16 and not self.released:
                self.by_name[name].copy_(value)

    def copy_to_model(self) -> None:
        """After an optimizer step (or a checkpoint load): the stage computes with the masters'
        new values."""
        if self.precision is Precision.FP32 or self.released:
            return
        with torch.no_grad():
            for (_, param), (_, master) in zip(
                self.stage.full_parameters(), self.named, strict=True
            ):
                param.copy_(master)


def _accumulate_into(master: nn.Parameter):
    """A hook that adds a bf16 weight's fresh gradient into its master's fp32 grad and frees it,
    so the sum over micro-batches is taken in fp32 (Megatron's main_grad)."""

    def hook(param: torch.Tensor) -> None:
        if master.grad is None:
            master.grad = param.grad.float()
        else:
            master.grad.add_(param.grad)
        param.grad = None

    return hook


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
