"""What one transformer layer of the runtime (runtime.model.Layer) asks of a device, forward and
backward, for one micro-batch on one of ``tp`` ranks: every operation torch dispatches, by its
aten name as the dispatcher sees it (views and aliases aside, as profiler.op_counts counts them),
with the bytes it reads and writes, the FLOPs of each GEMM and of the attention kernel, and the
bytes the forward keeps for the backward.

One description, two readers: the predictor prices it (GEMMs and attention at the device's GEMM
efficiency, the rest by bytes at its memory bandwidth, the host by the operation count), and
tests/test_layer_ops.py holds it to the runtime's own dispatch trace, operation by operation. A
change to the layer that changes what it dispatches or keeps fails that test until this file
says the same. It sits in spec, below both the predictor and the runtime, as the schedules do.

The layer (fused GEMMs): norm; one QKV GEMM whose output is split into q, k and v views (per
KV head: its queries, its key, its value; Llama rotates q and k and copies v); causal SDPA
(grouped-query by ``enable_gqa``, no repeat of K and V); the output projection (row-parallel);
residual add; norm; one gate|up GEMM chunked in two with SiLU(gate) * up (GPT: fc1, GELU, fc2);
the down projection; residual add.

Bytes of an operation: each tensor it reads or writes, counted once for every element it
addresses (a broadcast dimension, of stride 0, counts once). An operation writing in place
writes its input; one writing into an ``out=`` tensor writes it without reading it; an
allocation (empty) moves none. Structure only: shapes and dtypes; no device speed lives here.

Kernels: on the CPU (torch 2.13), RMSNorm runs as separate operations in fp32 (upcast from bf16
and back) and LayerNorm keeps its statistics in the input's dtype; on an accelerator RMSNorm is
one fused kernel each way (aten._fused_rms_norm) and both norms keep fp32 statistics. Only the
CPU's side is checked against a trace here (no GPU in CI); the accelerator's norm and attention
names follow torch's CUDA dispatch (flash attention in bf16, memory-efficient attention in fp32).
A third description, Kernels.MEGATRON_LM, is not hethub's layer: it is Megatron-LM's GPT layer,
which the measured A100 runs (measurements/a100) ran, so that they are priced as what ran.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
from dataclasses import dataclass

from hethub.errors import HethubError
from hethub.spec.model import ModelSpec
from hethub.spec.plan import Precision, Recompute

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


@functools.cache  # read for every stage of every prediction, and two enums pick it
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
class _Shape:
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
    def shard(self) -> _Shape:
        """This rank's sequence shard under sequence parallelism: tokens / tp."""
        return dataclasses.replace(self, tokens=self.tokens // self.tp, seq=self.seq // self.tp)


@dataclass(frozen=True, slots=True)
class _Piece:
    forward: tuple[Op, ...]
    backward: tuple[Op, ...]
    saved: int


def _linear(x: _Shape, inputs: int, outputs: int, *, row_parallel: bool, bias: bool) -> _Piece:
    """A linear of ``inputs`` -> ``outputs`` features on this rank, with a bias or not: its
    GEMM, its tensor-parallel all-reduce (row-parallel: of the output, forward, before the bias
    is added; column-parallel: of the input's gradient, backward), and its gradients. What its
    GEMM keeps (the input) is counted where the input is made."""
    e, collective = x.element, x.tp > 1
    separate_bias = bias and row_parallel and collective
    forward = [gemm(x.tokens, inputs, outputs, e, bias=bias and not separate_bias)]
    backward = [gemm(x.tokens, outputs, inputs, e), gemm(outputs, x.tokens, inputs, e)]
    if x.sequence_parallel and collective:
        return _sequence_parallel_linear(x, outputs, row_parallel, bias, forward, backward)
    if row_parallel and collective:
        forward.append(Op("allreduce_", OpKind.COLLECTIVE, x.bytes(outputs), x.bytes(outputs)))
    if separate_bias:
        forward.append(memory("add", x.bytes(outputs) + outputs * e, x.bytes(outputs)))
    if bias:  # the bias's gradient: the output's gradient summed over the tokens
        backward.append(memory("sum", x.bytes(outputs), outputs * e))
    if not row_parallel and collective:
        backward.append(Op("allreduce_", OpKind.COLLECTIVE, x.bytes(inputs), x.bytes(inputs)))
    return _Piece(tuple(forward), tuple(backward), 0)


def _sequence_parallel_linear(
    x: _Shape, outputs: int, row_parallel: bool, bias: bool, forward: list[Op], backward: list[Op]
) -> _Piece:
    """_linear under sequence parallelism, its GEMMs given: a column-parallel linear's input
    comes gathered (_gathered, where the norm is) and has no collective of its own; a
    row-parallel one reduce-scatters its output (its gradient all-gathered back), and its
    bias is added on the shard, its gradient summed over the shard's tokens and over TP."""
    e = x.element
    if row_parallel:
        scatter = _reduce_scattered(x, outputs)
        forward += scatter.forward
        backward += scatter.backward
    if bias and row_parallel:
        shard = x.shard.bytes(outputs)
        forward.append(memory("add", shard + outputs * e, shard))
        backward += [memory("sum", shard, outputs * e), *_summed_gradient(outputs * e)]
    elif bias:
        backward.append(memory("sum", x.bytes(outputs), outputs * e))
    return _Piece(tuple(forward), tuple(backward), 0)


def _all_gather(x: _Shape, width: int) -> tuple[Op, ...]:
    """runtime.tensor_parallel's sequence all-gather of (tokens/tp, width) on each rank into
    (tokens, width): an allocation, the collective (it reads its output buffer and the shard),
    and with more than one sequence a micro-batch the copy laying the sequence back (the
    collective concatenates the ranks' shards along the batch)."""
    whole, shard = x.bytes(width), x.shard.bytes(width)
    ops = [memory("empty", 0, 0), Op(ALL_GATHER, OpKind.COLLECTIVE, whole + shard, whole)]
    if x.batch > 1:
        ops.append(memory("clone", whole, whole))
    return tuple(ops)


def _reduce_scatter(x: _Shape, width: int) -> tuple[Op, ...]:
    """runtime.tensor_parallel's sequence reduce-scatter of (tokens, width) partial sums into
    this rank's (tokens/tp, width): with more than one sequence a micro-batch the copy putting
    each rank's slice in one block, an allocation, the collective, and on the CPU gloo's copy of
    the result into it."""
    whole, shard = x.bytes(width), x.shard.bytes(width)
    ops = [memory("clone", whole, whole)] if x.batch > 1 else []
    ops += [memory("empty", 0, 0), Op(REDUCE_SCATTER, OpKind.COLLECTIVE, whole + shard, shard)]
    if x.kernels is Kernels.CPU:
        ops.append(memory("copy_", 2 * shard, shard))
    return tuple(ops)


def _gathered(x: _Shape, width: int) -> _Piece:
    """gather_from_sequence before a column-parallel block: all-gather forward, reduce-scatter
    of the (partial) input gradient backward. The gathered input is what the block's GEMM
    keeps, counted here in the norm's place (_norm_on_shard)."""
    return _Piece(_all_gather(x, width), _reduce_scatter(x, width), 0)


def _reduce_scattered(x: _Shape, width: int) -> _Piece:
    """reduce_scatter_to_sequence after a row-parallel block: reduce-scatter forward,
    all-gather of the gradient backward."""
    return _Piece(_reduce_scatter(x, width), _all_gather(x, width), 0)


def _summed_gradient(weight_bytes: int) -> tuple[Op, ...]:
    """sum_gradient's backward for a weight every TP rank holds whole (a norm's, a row-parallel
    bias): its all-reduce, then a new tensor for its .grad."""
    return (
        Op(ALL_REDUCE, OpKind.COLLECTIVE, weight_bytes, weight_bytes),
        memory("clone", weight_bytes, weight_bytes),
    )


def _norm(x: _Shape) -> _Piece:
    """LayerNorm (GPT) or RMSNorm (Llama) over the hidden features, with its weight's (and
    bias's) gradient, and what it and its output keep: its input and statistics, and its output,
    which the next GEMM keeps."""
    h, e, rows = x.hidden, x.element, x.tokens
    act, stat_bytes = x.bytes(h), (e if x.kernels is Kernels.CPU else FP32_BYTES)
    if x.gpt:
        stats = 2 * rows * stat_bytes  # mean and 1/std per token
        forward = (memory("native_layer_norm", act + 2 * h * e, act + stats),)
        backward = (
            memory("native_layer_norm_backward", 2 * act + stats + 2 * h * e, act + 2 * h * e),
        )
        return _Piece(forward, backward, act + stats + act)
    rstd = rows * FP32_BYTES
    if x.kernels is Kernels.FUSED:
        forward = (memory("_fused_rms_norm", act + h * e, act + rstd),)
        backward = (memory("_fused_rms_norm_backward", 2 * act + rstd + h * e, act + h * e),)
        return _Piece(forward, backward, act + rstd + act)
    return _cpu_rms_norm(x)


def _norm_on_shard(x: _Shape) -> _Piece:
    """Sequence parallelism's norm: _norm over this rank's tokens/tp, its weights' (GPT: and
    bias's) gradients summed over TP, then its output gathered (_gathered). It keeps its input
    and statistics on the shard, and the gathered output the next GEMM keeps (tokens, h)."""
    h, e, shard = x.hidden, x.element, x.shard
    norm = _norm(shard)
    sums = _summed_gradient(h * e) * (2 if x.gpt else 1)
    kept = norm.saved - shard.bytes(h) + x.bytes(h)  # its own output is gathered, whole, then kept
    return _join(_Piece(norm.forward, norm.backward + sums, kept), _gathered(x, h))


def _cpu_rms_norm(x: _Shape) -> _Piece:
    """The runtime's CPU RMSNorm (runtime.model.RMSNorm; torch's is a composite there): x^2,
    mean, + eps, rsqrt, x * rstd, * w, in fp32 (a bf16 input is cast up first and the output
    cast back); backward, from the input and rstd, the normalised input again, the weight's
    gradient and the input's, in fp32. It keeps what the fused kernel keeps: its input and rstd."""
    h, e = x.hidden, x.element
    full, row, weight = x.bytes(h, FP32_BYTES), x.tokens * FP32_BYTES, h * e
    dy, cast = x.bytes(h), e != FP32_BYTES
    forward = [
        memory("pow", full, full),
        memory("mean", full, row),
        memory("add_", row, row),
        memory("rsqrt", row, row),
        memory("mul", full + row, full),  # x * rstd
        memory("mul_", full + weight, full),  # * w
    ]
    backward = [
        memory("mul", full + row, full),  # the normalised input n = x * rstd, again
        memory("mul", dy + full, full),  # dy * n: the weight's gradient, per token
        memory("sum", full, h * FP32_BYTES),
        memory("mul_", full + weight, full),  # dy * n * w = g * n
        memory("mean", full, row),
        memory("neg_", row, row),
        memory("mul_", full + row, full),  # n * -mean(g n)
        memory("addcmul_", full + dy + weight, full),  # + dy * w = g
        memory("mul_", full + row, full),  # * rstd
    ]
    if cast:
        low = x.bytes(h)
        forward = [memory("_to_copy", low, full), *forward, memory("_to_copy", full, low)]
        backward = [
            memory("_to_copy", low, full),  # the input
            *backward,
            memory("_to_copy", h * FP32_BYTES, weight),  # the weight's gradient
            memory("_to_copy", full, low),
        ]
    # Its input, rstd, and its output, which the next GEMM keeps.
    return _Piece(tuple(forward), tuple(backward), x.bytes(h) + row + x.bytes(h))


def _rotary(x: _Shape, width: int) -> _Piece:
    """x * cos + roll(x) * sin over ``width`` features (Rotary.forward's mul, roll, addcmul);
    backward: the two products' gradients, rolled back, summed. Keeps only the tables."""
    act, table = x.bytes(width), x.seq * x.head_dim * x.element
    forward = (
        memory("mul", act + table, act),
        memory("roll", act, act),
        memory("addcmul", 2 * act + table, act),
    )
    backward = (
        memory("mul", table, table),  # addcmul's value times its table
        memory("mul", act + table, act),
        memory("roll", act, act),
        memory("mul", act + table, act),
        memory("add", 2 * act, act),
    )
    return _Piece(forward, backward, 0)


def _log_sum_exp_bytes(x: _Shape) -> int:
    """The attention kernel's fp32 log-sum-exp, one per query of each head."""
    return x.batch * x.heads * x.seq * FP32_BYTES


def _attention_kernel(x: _Shape) -> _Piece:
    """Causal SDPA over q (heads) and k, v (kv_heads): it keeps q, k, v, its output and the
    fp32 log-sum-exp per query (the saving of q, k and v is counted where they are made)."""
    lse = _log_sum_exp_bytes(x)
    q, kv = x.bytes(x.q), x.bytes(x.kv)
    flops = causal_attention_flops(x.batch, x.heads, x.seq, x.head_dim)
    narrowest = min(x.seq, x.head_dim)
    cpu, bf16 = x.kernels is Kernels.CPU, x.element != FP32_BYTES
    name = (
        "_scaled_dot_product_flash_attention_for_cpu"
        if cpu
        else "_scaled_dot_product_flash_attention"
        if bf16
        else "_scaled_dot_product_efficient_attention"
    )
    forward = Op(name, OpKind.ATTENTION, q + 2 * kv, q + lse, flops, narrowest)
    backward = Op(
        f"{name}_backward",
        OpKind.ATTENTION,
        3 * q + 2 * kv + lse,  # output's gradient, q, k, v, output, log-sum-exp
        q + 2 * kv,
        int(ATTENTION_BACKWARD_FLOPS * flops),
        narrowest,
    )
    return _Piece((forward,), (backward,), q + lse)


def _attention(x: _Shape) -> _Piece:
    """QKV GEMM, the inner part (_inner_attention), output projection. The kernel keeps q, k and
    v: GPT's are views of the QKV output, which it keeps whole; Llama's rotated q and k are new
    tensors, and its v is copied out of the QKV output, so that none of that output outlives
    the forward. Backward: the three gradients are concatenated, read where they lie."""
    h, qkv = x.hidden, x.q + 2 * x.kv
    first = _linear(x, h, qkv, row_parallel=False, bias=x.qkv_bias)
    last = _linear(x, x.q, h, row_parallel=True, bias=x.o_bias)
    grads = x.bytes(x.q) + 2 * x.bytes(x.kv)
    cat = _Piece((), (memory("cat", grads, x.bytes(qkv)),), x.bytes(qkv))
    return _join(first, _inner_attention(x), last, cat)


def _inner_attention(x: _Shape) -> _Piece:
    """From the QKV output to the output projection's input (runtime.model.Layer.
    inner_attention): Llama's rotations of q and k and copy of v, and the kernel."""
    pieces = []
    if not x.gpt:
        copy_v = memory("clone", x.bytes(x.kv), x.bytes(x.kv))
        pieces += [_rotary(x, x.q), _rotary(x, x.kv), _Piece((copy_v,), (), 0)]
    return _join(*pieces, _attention_kernel(x))


def _selective(x: _Shape, layer: _Piece) -> LayerOps:
    """``layer`` under selective recomputation: the attention's inner part is checkpointed, its
    forward run again in the backward. It then keeps its input, the QKV output, in place of
    q, k and v, of the same bytes (Llama's rotated copies, GPT's views of that output), and the
    output projection keeps the kernel's output either way: what it no longer keeps is the
    kernel's log-sum-exp alone (a flash kernel keeps no scores). Megatron-LM's layer (no flash
    kernel) no longer keeps its scores' softmax, dropout output and mask."""
    if x.kernels is Kernels.MEGATRON_LM:
        inner = _megatron_core_attention(x)
        freed = inner.saved - 4 * x.bytes(x.q)  # q, k, v (the QKV output) and the context stay
    else:
        inner, freed = _inner_attention(x), _log_sum_exp_bytes(x)
    return LayerOps(layer.forward, inner.forward + layer.backward, layer.saved - freed)


def _mlp(x: _Shape) -> _Piece:
    """GPT: fc1, GELU, fc2; it keeps fc1's output and GELU's. Llama: one gate|up GEMM, SiLU(gate)
    * up of its halves, down; it keeps the gate|up output and the product (not SiLU's output,
    which the backward recomputes, as Megatron-LM's fused SwiGLU does)."""
    h, f, act = x.hidden, x.ffn, x.bytes(x.ffn)
    if x.gpt:
        gelu = _Piece((memory("gelu", act, act),), (memory("gelu_backward", 2 * act, act),), 0)
        first = _linear(x, h, f, row_parallel=False, bias=True)
        second = _linear(x, f, h, row_parallel=True, bias=True)
        return _join(first, gelu, second, _Piece((), (), 2 * act))
    swiglu = _Piece(  # runtime.model._SwiGlu, on every device
        (memory("silu", act, act), memory("mul_", 2 * act, act)),
        (
            memory("empty", 0, 0),  # the gradient, both halves
            memory("mul", 2 * act, act),  # dy * up, into the gate's half
            memory("silu_backward", 2 * act, act),  # there, in place: d gate
            memory("silu", act, act),  # SiLU(gate) again, into the up's half
            memory("mul_", 2 * act, act),  # times dy: d up
        ),
        2 * act + act,  # gate|up, the product
    )
    first = _linear(x, h, 2 * f, row_parallel=False, bias=False)
    second = _linear(x, f, h, row_parallel=True, bias=False)
    return _join(first, swiglu, second)


def _residual(x: _Shape) -> _Piece:
    """x + block(norm(x)): the add, and backward the sum of x's two gradients (through the
    block and straight through). It keeps nothing."""
    act = x.bytes(x.hidden)
    return _Piece((memory("add", 2 * act, act),), (memory("add", 2 * act, act),), 0)


def _join(*pieces: _Piece) -> _Piece:
    return _Piece(
        tuple(op for p in pieces for op in p.forward),
        tuple(op for p in pieces for op in p.backward),
        sum(p.saved for p in pieces),
    )


@functools.lru_cache(maxsize=4096)
def layer_ops(
    model: ModelSpec,
    tp: int,
    micro_batch: int,
    precision: Precision,
    kernels: Kernels,
    recompute: Recompute = Recompute.NONE,
    *,
    sequence_parallel: bool = False,
) -> LayerOps:
    """The operations of one layer of ``model`` on one of ``tp`` ranks, one micro-batch of
    ``micro_batch`` sequences, computing in ``precision``'s dtype on ``kernels``;
    ``sequence_parallel`` (at tp > 1): runtime.model.Layer's sequence-parallel forward."""
    x = _Shape(
        tokens=micro_batch * model.seq_len,
        batch=micro_batch,
        seq=model.seq_len,
        hidden=model.hidden,
        head_dim=model.head_dim,
        heads=model.heads // tp,
        kv_heads=model.kv_heads // tp,
        ffn=model.ffn_hidden // tp,
        tp=tp,
        element=precision.element_bytes,
        kernels=kernels,
        gpt=model.arch == "gpt",
        qkv_bias=model.qkv_bias,
        o_bias=model.o_bias,
        sequence_parallel=sequence_parallel and tp > 1,
    )
    if kernels is Kernels.MEGATRON_LM:
        if x.sequence_parallel:
            raise HethubError(
                f"kernels {Kernels.MEGATRON_LM.value!r} describe the measured A100 runs' "
                f"Megatron-LM layer, which ran without sequence parallelism"
            )
        layer = _megatron_gpt_layer(x, model.arch)
    elif x.sequence_parallel:
        norm, residual = _norm_on_shard(x), _residual(x.shard)
        layer = _join(norm, _attention(x), residual, norm, _mlp(x), residual)
    else:
        layer = _join(_norm(x), _attention(x), _residual(x), _norm(x), _mlp(x), _residual(x))
    if recompute is Recompute.FULL:
        return LayerOps(layer.forward, layer.forward + layer.backward, 0)
    if recompute is Recompute.SELECTIVE:
        return _selective(x, layer)
    return LayerOps(layer.forward, layer.backward, layer.saved)


# Megatron-LM's GPT layer (Kernels.MEGATRON_LM), as the measured A100 runs launched it: LayerNorm
# (apex's fused kernel); the QKV GEMM with its bias; the scores Q K^T over every query-key pair
# (baddbmm, reading q and k as views of the QKV output: Megatron's CoreAttention reshapes them
# with view() and hands the batched GEMMs transposed views, no copy; the mask comes after); the
# fused scale-mask-softmax (torch's, in fp32, where its kernel does not take the shape); dropout
# on the probabilities with its 1-byte mask; the values GEMM (bmm, v a view too); the context
# laid back out (1 copy); the projection GEMM without its bias, which the fused bias-dropout-add
# adds; LayerNorm; fc1 without its bias; the fused bias-GELU;
# fc2; the fused bias-dropout-add: 14 operations forward (the tensor-parallel all-reduces aside).
# Backward, the gradients of q, k and v are laid back into the QKV output's (3 copies' traffic,
# split's backward). With the fused softmax it keeps what Korthikanti et al. 2022,
# eq. 2 counts, sbh (10 + 24/t + 5as/(ht)) bytes at 2-byte elements, and nothing else (their
# count leaves out the LayerNorms' fp32 statistics, 16 bytes a token: so does this).


def batched_gemm(name: str, batch: int, rows: int, inner: int, cols: int, element: int) -> Op:
    """``batch`` products (rows x inner) @ (inner x cols) in one kernel (bmm, baddbmm)."""
    read = batch * (rows * inner + inner * cols) * element
    flops = 2 * batch * rows * inner * cols
    return Op(name, OpKind.GEMM, read, batch * rows * cols * element, flops, min(rows, inner, cols))


def _megatron_linear(
    x: _Shape, inputs: int, outputs: int, *, row_parallel: bool, bias_in_gemm: bool
) -> _Piece:
    """A Megatron linear: its GEMM (with the bias where the next kernel does not add it), the
    row-parallel all-reduce of its output forward or the column-parallel one of its input's
    gradient backward, its two gradient GEMMs and its bias's gradient (a sum over the tokens)."""
    e, collective = x.element, x.tp > 1
    forward = [gemm(x.tokens, inputs, outputs, e, bias=bias_in_gemm)]
    if row_parallel and collective:
        forward.append(Op("allreduce_", OpKind.COLLECTIVE, x.bytes(outputs), x.bytes(outputs)))
    backward = [
        gemm(x.tokens, outputs, inputs, e),
        gemm(outputs, x.tokens, inputs, e),
        memory("sum", x.bytes(outputs), outputs * e),
    ]
    if not row_parallel and collective:
        backward.append(Op("allreduce_", OpKind.COLLECTIVE, x.bytes(inputs), x.bytes(inputs)))
    return _Piece(tuple(forward), tuple(backward), 0)


def _megatron_layer_norm(x: _Shape) -> _Piece:
    """apex's fused LayerNorm, and the sum of the residual stream's two gradients after its
    backward. It keeps its input (its output is kept by the GEMM that reads it)."""
    h, e, act = x.hidden, x.element, x.bytes(x.hidden)
    stats = 2 * x.tokens * FP32_BYTES
    forward = (memory("fused_layer_norm", act + 2 * h * e, act + stats),)
    backward = (
        memory("fused_layer_norm_backward", 2 * act + stats + 2 * h * e, act + 2 * h * e),
        memory("add", 2 * act, act),
    )
    return _Piece(forward, backward, act + act)


def _bias_dropout_add(x: _Shape) -> _Piece:
    """The fused residual + dropout(y + bias): it keeps only its mask. Backward: the mask
    applied to the gradient (the residual's gradient passes through as it is)."""
    h, e, act = x.hidden, x.element, x.bytes(x.hidden)
    mask = x.tokens * h * MASK_BYTES
    forward = (memory("bias_dropout_add", 2 * act + h * e, act + mask),)
    backward = (memory("bias_dropout_add_backward", act + mask, act),)
    return _Piece(forward, backward, mask)


def megatron_fused_softmax(batch: int, heads: int, seq: int) -> bool:
    """Whether Megatron-LM's causal softmax runs its fused kernel (FusedScaleMaskSoftmax.
    is_kernel_available): keys 16 < s <= 4096, s a multiple of 4, and the attention batches
    (micro-batch x heads of the rank) a multiple of 4 and of the kernel's batches per block
    (scaled_masked_softmax.h: 128 threads in warps of min(2^ceil(log2 s), 32) threads, 2 rows a
    warp up to 128 keys, 1 above). Else it runs torch's softmax in fp32."""
    if not (16 < seq <= 4096 and seq % 4 == 0 and (batch * heads) % 4 == 0):
        return False
    padded = 1 << (seq - 1).bit_length()
    per_block = 128 // min(padded, 32) * (2 if padded <= 128 else 1)
    return (batch * heads) % per_block == 0


def _megatron_softmax(x: _Shape, scores: int) -> _Piece:
    """Megatron's causal softmax over ``scores`` bytes of scores: its fused kernel (the
    probabilities kept), or where that is not available (megatron_fused_softmax) torch's in fp32:
    the scores upcast, scaled (query-key layer scaling), masked in place, softmax, cast back;
    the fp32 probabilities kept, and the causal mask (one per sequence, a broadcast read)."""
    if megatron_fused_softmax(x.batch, x.heads, x.seq):
        return _Piece(
            (memory("scaled_upper_triang_masked_softmax", scores, scores),),
            (memory("scaled_upper_triang_masked_softmax_backward", 2 * scores, scores),),
            scores,
        )
    wide = scores // x.element * FP32_BYTES
    mask = x.batch * x.heads * x.seq * x.seq * MASK_BYTES
    return _Piece(
        (
            memory("_to_copy", scores, wide),
            memory("mul", wide, wide),
            memory("masked_fill_", wide + mask, wide),
            memory("_softmax", wide, wide),
            memory("_to_copy", wide, scores),
        ),
        (
            memory("_to_copy", scores, wide),
            memory("_softmax_backward_data", 2 * wide, wide),
            memory("masked_fill", wide + mask, wide),
            memory("mul", wide, wide),
            memory("_to_copy", wide, scores),
        ),
        wide,
    )


def _megatron_core_attention(x: _Shape) -> _Piece:
    """Scores (q and k read as views), softmax, dropout, values (v a view), the context laid
    back out. It keeps q, k and v (the QKV output they view), the probabilities, the dropout's
    mask and output, and the context."""
    e, s, d, batch = x.element, x.seq, x.head_dim, x.batch * x.heads
    scores, mask, width = batch * s * s * e, batch * s * s * MASK_BYTES, x.bytes(x.q)
    copy = memory("clone", width, width)
    scale = memory("mul", width, width)  # by baddbmm's alpha, 1/sqrt(d), in its backward
    softmax = _megatron_softmax(x, scores)
    forward = (
        batched_gemm("baddbmm", batch, s, d, s, e),
        *softmax.forward,
        memory("native_dropout", scores, scores + mask),
        batched_gemm("bmm", batch, s, s, d, e),
        copy,
    )
    backward = (
        copy,  # the context's gradient laid out for the values GEMM's
        batched_gemm("bmm", batch, s, d, s, e),  # the probabilities' gradient: dC V^T
        batched_gemm("bmm", batch, s, s, d, e),  # v's: P^T dC
        memory("native_dropout_backward", scores + mask, scores),
        *softmax.backward,
        batched_gemm("bmm", batch, s, s, d, e),  # q's: dS K
        scale,
        batched_gemm("bmm", batch, s, s, d, e),  # k's: dS^T Q
        scale,
        copy,
        copy,
        copy,  # q's, k's and v's gradients laid back into the QKV output's
    )
    return _Piece(forward, backward, 3 * width + softmax.saved + scores + mask + width)


def _megatron_gpt_layer(x: _Shape, arch: str) -> _Piece:
    """Megatron-LM's GPT layer (Kernels.MEGATRON_LM); the fc1 and fc2 inputs and the GELU's
    input are kept, the MLP's activation by the fused bias-GELU."""
    if not x.gpt:
        raise HethubError(
            f"kernels {Kernels.MEGATRON_LM.value!r} describe Megatron-LM's GPT layer (the measured "
            f"A100 runs'), not a {arch!r} layer: price a {arch!r} model with its device's kernels"
        )
    h, f, e = x.hidden, x.ffn, x.element
    fc1 = x.bytes(f)
    bias_gelu = _Piece(
        (memory("bias_gelu", fc1 + f * e, fc1),),
        (memory("bias_gelu_backward", 2 * fc1 + f * e, fc1),),
        fc1 + fc1,  # the GELU's input, and its output (fc2's input)
    )
    return _join(
        _megatron_layer_norm(x),
        _megatron_linear(x, h, x.q + 2 * x.kv, row_parallel=False, bias_in_gemm=True),
        _megatron_core_attention(x),
        _megatron_linear(x, x.q, h, row_parallel=True, bias_in_gemm=False),
        _bias_dropout_add(x),
        _megatron_layer_norm(x),
        _megatron_linear(x, h, f, row_parallel=False, bias_in_gemm=False),
        bias_gelu,
        _megatron_linear(x, f, h, row_parallel=True, bias_in_gemm=False),
        _bias_dropout_add(x),
    )
