"""The vocabulary of a layer's description (spec.layer_ops, spec.megatron_layer): an operation
as the dispatcher runs it, with the bytes it reads and writes and the FLOPs of a GEMM; a layer's
dimensions on one rank; a part of a layer (its forward's and backward's operations and the bytes
it keeps); the kernels a device runs; and the bytes the trainer around a layer moves per
parameter. Structure only: shapes and dtypes; no device speed lives here."""

from __future__ import annotations

import collections
import dataclasses
import enum
from dataclasses import dataclass

from hethub.memo import memoized
from hethub.spec.plan import Precision

FP32_BYTES = 4
"""Norm statistics, the CPU RMSNorm's working copy and the attention's log-sum-exp are fp32."""


MASK_BYTES = 1
"""A dropout mask (Megatron-LM's layer): one bool a element."""


class Kernels(enum.StrEnum):
    """Which kernels torch dispatches a layer's norms and attention to."""

    CPU = "cpu"
    """torch's CPU kernels: RMSNorm as separate fp32 operations, flash attention for the CPU."""
    FUSED = "fused"
    """An accelerator's: fused RMSNorm, flash (bf16) or memory-efficient (fp32) attention."""
    MEGATRON_LM = "megatron-lm"
    """Not hethub's layer: Megatron-LM's GPT layer as the measured A100 runs launched it (no
    flash attention; the scores in memory; fused softmax, bias-GELU and bias-dropout-add).
    Described from its code and Korthikanti et al. 2022, not traced: there is no Megatron here.
    GPT only; never a device's own kernels (of_vendor), only a prediction's told so."""

    @classmethod
    def of_vendor(cls, vendor: str) -> Kernels:
        """The kernels of a device of ``vendor`` (spec.accelerator.VENDORS)."""
        return cls.CPU if vendor == "cpu" else cls.FUSED


class OpKind(enum.StrEnum):
    """How the predictor prices an operation."""

    GEMM = "gemm"
    """By its FLOPs at the device's GEMM efficiency for its narrowest dimension."""
    ATTENTION = "attention"
    """The fused attention kernel: by its FLOPs, as GEMMs over head_dim channels."""
    MEMORY = "memory"
    """Memory-bound: by the bytes it moves at the device's memory bandwidth."""
    COLLECTIVE = "collective"
    """A tensor-parallel collective (all-reduce; under sequence parallelism all-gather and
    reduce-scatter): by the communicator's cost for its bytes (collective_kind)."""


@dataclass(frozen=True, slots=True)
class Op:
    """One dispatched operation."""

    name: str
    """Its aten name (the overload packet's), as profiler.op_counts.OpCounter counts it."""
    kind: OpKind
    read: int
    """Bytes of its inputs."""
    written: int
    """Bytes of its outputs."""
    flops: int = 0
    """GEMM and attention FLOPs (2 per multiply-add); 0 for the others."""
    narrowest: int = 0
    """A GEMM's narrowest dimension (attention: the head's channels), what its efficiency
    rises with; 0 for the others."""

    @property
    def bytes_moved(self) -> int:
        return self.read + self.written


@dataclass(frozen=True, slots=True)
class LayerOps:
    """One layer, one micro-batch, one rank."""

    forward: tuple[Op, ...]
    backward: tuple[Op, ...]
    """With full recomputation, the forward run again inside the backward comes first; with
    selective, the attention's inner part run again (the ops of Recompute.SELECTIVE)."""
    saved_bytes: int
    """Bytes of the distinct tensors (storages) the forward keeps for the backward, the
    parameters and the rotary tables (a stage's, shared by its layers) aside; 0 under full
    recomputation, where the recomputed chunk keeps only its input, the stage's."""


ALL_REDUCE = "allreduce_"


ALL_GATHER = "_allgather_base_"


REDUCE_SCATTER = "_reduce_scatter_base_"
"""The TP collectives' names as torch dispatches them (c10d's ops)."""


def collective_bytes(op: Op) -> int:
    """The bytes a TP collective ``op`` carries for each rank, what its cost is priced on: an
    all-reduce's tensor, an all-gather's output, a reduce-scatter's input (the whole (B, T, h)
    of its rank's partial sums). The all-gather and reduce-scatter that sequence parallelism puts
    in place of an all-reduce of the same tensor each carry it once: the same bytes."""
    if op.name == ALL_GATHER:
        return op.written
    if op.name == REDUCE_SCATTER:
        return op.read - op.written
    return op.written


@dataclass(frozen=True, slots=True)
class TrainerBytes:
    """What the trainer around a layer moves per parameter (outside the layer's own operations,
    which its trace holds): each micro-batch's weight gradients joining the step's, the
    data-parallel sync's gradients, and the optimizer step."""

    accumulation: int
    grad_sync: int
    optimizer: int


MEGATRON_FP16_OPTIMIZER_BYTES = 2 + 4 + 2 * 4 + 4 + 4 * 4 + 3 * 4 + 4 + 2
"""Megatron-LM's fp16 optimizer of 2021, a step: the 16-bit gradient copied into the fp32 main
gradient (2 + 4), unscaled with its inf/nan check (4 + 4), the gradient norm for clipping (4),
Adam reading the main gradient, the fp32 weight and both moments (16) and writing the three
(12), and the fp32 weight copied back to the 16-bit one (4 + 2): 52."""


@memoized  # read for every stage of every prediction, and two enums pick it
def trainer_bytes(kernels: Kernels, precision: Precision) -> TrainerBytes:
    """Per parameter, what the trainer of ``kernels``' layer moves.

    hethub's runtime (every device's own kernels): each chunk's backward adds its gradients into
    the fp32 main gradients in one foreach operation (Precision.grad_accumulation_bytes), the
    sync sums the fp32 main gradients, and its fused AdamW steps without clipping
    (Precision.optimizer_bytes_moved). Megatron-LM's 16-bit runs of 2021 (Kernels.MEGATRON_LM):
    autograd adds each micro-batch's fp16 gradients in place (read both, write one: 6), its
    gradient buffer is fp16, so the sync sums 2 bytes a parameter (only its bf16 runs
    accumulate in fp32), and its fp16 optimizer moves MEGATRON_FP16_OPTIMIZER_BYTES."""
    if kernels is Kernels.MEGATRON_LM:
        return TrainerBytes(3 * 2, 2, MEGATRON_FP16_OPTIMIZER_BYTES)
    return TrainerBytes(
        precision.grad_accumulation_bytes,
        precision.main_grad_bytes,
        precision.optimizer_bytes_moved,
    )


def op_counts(ops: tuple[Op, ...]) -> collections.Counter[str]:
    """How many operations of each name ``ops`` holds."""
    return collections.Counter(op.name for op in ops)


def memory(name: str, read: int, written: int) -> Op:
    return Op(name, OpKind.MEMORY, read, written)


def gemm(rows: int, inner: int, cols: int, element: int, bias: bool = False) -> Op:
    """(rows x inner) @ (inner x cols), as aten.mm, or aten.addmm adding a bias of ``cols``."""
    read = (rows * inner + inner * cols + (cols if bias else 0)) * element
    return Op(
        "addmm" if bias else "mm",
        OpKind.GEMM,
        read,
        rows * cols * element,
        2 * rows * inner * cols,
        min(rows, inner, cols),
    )


def causal_attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> int:
    """Forward FLOPs of causal attention's two products (Q K^T, then by V) over the query-key
    pairs a causal kernel computes: seq (seq + 1) / 2 per head, not seq^2."""
    return 2 * 2 * batch * heads * head_dim * seq * (seq + 1) // 2


ATTENTION_BACKWARD_FLOPS = 2.5
"""Backward of flash attention per forward FLOP: five products (Q K^T again, dV, dP, dQ, dK)
against the forward's two."""


@dataclass(frozen=True, slots=True)
class LayerDims:
    """The layer's dimensions on one rank, and the bytes of one element."""

    tokens: int
    batch: int
    seq: int
    hidden: int
    head_dim: int
    heads: int
    kv_heads: int
    ffn: int
    tp: int
    element: int
    kernels: Kernels
    gpt: bool
    qkv_bias: bool
    o_bias: bool
    """The attention's projections that add a bias (the spec's; GPT's MLP always does)."""
    sequence_parallel: bool = False
    """The norms and residual adds on this rank's tokens/tp, the blocks' inputs all-gathered and
    outputs reduce-scattered (tp > 1 only)."""

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    def bytes(self, width: int, element: int | None = None) -> int:
        """Bytes of a (tokens, width) tensor."""
        return self.tokens * width * (self.element if element is None else element)

    @property
    def shard(self) -> LayerDims:
        """This rank's sequence shard under sequence parallelism: tokens / tp."""
        return dataclasses.replace(self, tokens=self.tokens // self.tp, seq=self.seq // self.tp)


@dataclass(frozen=True, slots=True)
class PartOps:
    forward: tuple[Op, ...]
    backward: tuple[Op, ...]
    saved: int


def join_parts(*pieces: PartOps) -> PartOps:
    return PartOps(
        tuple(op for p in pieces for op in p.forward),
        tuple(op for p in pieces for op in p.backward),
        sum(p.saved for p in pieces),
    )
