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

from hethub.errors import HethubError
from hethub.memo import memoized
from hethub.spec.megatron_layer import megatron_core_attention, megatron_gpt_layer
from hethub.spec.model import ModelSpec
from hethub.spec.ops import (
    ALL_GATHER,
    ALL_REDUCE,
    ATTENTION_BACKWARD_FLOPS,
    FP32_BYTES,
    REDUCE_SCATTER,
    Kernels,
    LayerDims,
    LayerOps,
    Op,
    OpKind,
    PartOps,
    causal_attention_flops,
    gemm,
    join_parts,
    memory,
)
from hethub.spec.plan import Precision, Recompute


def _linear(x: LayerDims, inputs: int, outputs: int, *, row_parallel: bool, bias: bool) -> PartOps:
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
    return PartOps(tuple(forward), tuple(backward), 0)


def _sequence_parallel_linear(
    x: LayerDims,
    outputs: int,
    row_parallel: bool,
    bias: bool,
    forward: list[Op],
    backward: list[Op],
) -> PartOps:
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
    return PartOps(tuple(forward), tuple(backward), 0)


def _all_gather(x: LayerDims, width: int) -> tuple[Op, ...]:
    """runtime.tensor_parallel's sequence all-gather of (tokens/tp, width) on each rank into
    (tokens, width): an allocation, the collective (it reads its output buffer and the shard),
    and with more than one sequence a micro-batch the copy laying the sequence back (the
    collective concatenates the ranks' shards along the batch)."""
    whole, shard = x.bytes(width), x.shard.bytes(width)
    ops = [memory("empty", 0, 0), Op(ALL_GATHER, OpKind.COLLECTIVE, whole + shard, whole)]
    if x.batch > 1:
        ops.append(memory("clone", whole, whole))
    return tuple(ops)


def _reduce_scatter(x: LayerDims, width: int) -> tuple[Op, ...]:
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


def _gathered(x: LayerDims, width: int) -> PartOps:
    """gather_from_sequence before a column-parallel block: all-gather forward, reduce-scatter
    of the (partial) input gradient backward. The gathered input is what the block's GEMM
    keeps, counted here in the norm's place (_norm_on_shard)."""
    return PartOps(_all_gather(x, width), _reduce_scatter(x, width), 0)


def _reduce_scattered(x: LayerDims, width: int) -> PartOps:
    """reduce_scatter_to_sequence after a row-parallel block: reduce-scatter forward,
    all-gather of the gradient backward."""
    return PartOps(_reduce_scatter(x, width), _all_gather(x, width), 0)


def _summed_gradient(weight_bytes: int) -> tuple[Op, ...]:
    """sum_gradient's backward for a weight every TP rank holds whole (a norm's, a row-parallel
    bias): its all-reduce, then a new tensor for its .grad."""
    return (
        Op(ALL_REDUCE, OpKind.COLLECTIVE, weight_bytes, weight_bytes),
        memory("clone", weight_bytes, weight_bytes),
    )


def _norm(x: LayerDims) -> PartOps:
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
        return PartOps(forward, backward, act + stats + act)
    rstd = rows * FP32_BYTES
    if x.kernels is Kernels.FUSED:
        forward = (memory("_fused_rms_norm", act + h * e, act + rstd),)
        backward = (memory("_fused_rms_norm_backward", 2 * act + rstd + h * e, act + h * e),)
        return PartOps(forward, backward, act + rstd + act)
    return _cpu_rms_norm(x)


def _norm_on_shard(x: LayerDims) -> PartOps:
    """Sequence parallelism's norm: _norm over this rank's tokens/tp, its weights' (GPT: and
    bias's) gradients summed over TP, then its output gathered (_gathered). It keeps its input
    and statistics on the shard, and the gathered output the next GEMM keeps (tokens, h)."""
    h, e, shard = x.hidden, x.element, x.shard
    norm = _norm(shard)
    sums = _summed_gradient(h * e) * (2 if x.gpt else 1)
    kept = norm.saved - shard.bytes(h) + x.bytes(h)  # its own output is gathered, whole, then kept
    return join_parts(PartOps(norm.forward, norm.backward + sums, kept), _gathered(x, h))


def _cpu_rms_norm(x: LayerDims) -> PartOps:
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
    return PartOps(tuple(forward), tuple(backward), x.bytes(h) + row + x.bytes(h))


def _rotary(x: LayerDims, width: int) -> PartOps:
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
    return PartOps(forward, backward, 0)


def _log_sum_exp_bytes(x: LayerDims) -> int:
    """The attention kernel's fp32 log-sum-exp, one per query of each head."""
    return x.batch * x.heads * x.seq * FP32_BYTES


def _attention_kernel(x: LayerDims) -> PartOps:
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
    return PartOps((forward,), (backward,), q + lse)


def _attention(x: LayerDims) -> PartOps:
    """QKV GEMM, the inner part (_inner_attention), output projection. The kernel keeps q, k and
    v: GPT's are views of the QKV output, which it keeps whole; Llama's rotated q and k are new
    tensors, and its v is copied out of the QKV output, so that none of that output outlives
    the forward. Backward: the three gradients are concatenated, read where they lie."""
    h, qkv = x.hidden, x.q + 2 * x.kv
    first = _linear(x, h, qkv, row_parallel=False, bias=x.qkv_bias)
    last = _linear(x, x.q, h, row_parallel=True, bias=x.o_bias)
    grads = x.bytes(x.q) + 2 * x.bytes(x.kv)
    cat = PartOps((), (memory("cat", grads, x.bytes(qkv)),), x.bytes(qkv))
    return join_parts(first, _inner_attention(x), last, cat)


def _inner_attention(x: LayerDims) -> PartOps:
    """From the QKV output to the output projection's input (runtime.model.Layer.
    inner_attention): Llama's rotations of q and k and copy of v, and the kernel."""
    pieces = []
    if not x.gpt:
        copy_v = memory("clone", x.bytes(x.kv), x.bytes(x.kv))
        pieces += [_rotary(x, x.q), _rotary(x, x.kv), PartOps((copy_v,), (), 0)]
    return join_parts(*pieces, _attention_kernel(x))


def _selective(x: LayerDims, layer: PartOps) -> LayerOps:
    """``layer`` under selective recomputation: the attention's inner part is checkpointed, its
    forward run again in the backward. It then keeps its input, the QKV output, in place of
    q, k and v, of the same bytes (Llama's rotated copies, GPT's views of that output), and the
    output projection keeps the kernel's output either way: what it no longer keeps is the
    kernel's log-sum-exp alone (a flash kernel keeps no scores). Megatron-LM's layer (no flash
    kernel) no longer keeps its scores' softmax, dropout output and mask."""
    if x.kernels is Kernels.MEGATRON_LM:
        inner = megatron_core_attention(x)
        freed = inner.saved - 4 * x.bytes(x.q)  # q, k, v (the QKV output) and the context stay
    else:
        inner, freed = _inner_attention(x), _log_sum_exp_bytes(x)
    return LayerOps(layer.forward, inner.forward + layer.backward, layer.saved - freed)


def _mlp(x: LayerDims) -> PartOps:
    """GPT: fc1, GELU, fc2; it keeps fc1's output and GELU's. Llama: one gate|up GEMM, SiLU(gate)
    * up of its halves, down; it keeps the gate|up output and the product (not SiLU's output,
    which the backward recomputes, as Megatron-LM's fused SwiGLU does)."""
    h, f, act = x.hidden, x.ffn, x.bytes(x.ffn)
    if x.gpt:
        gelu = PartOps((memory("gelu", act, act),), (memory("gelu_backward", 2 * act, act),), 0)
        first = _linear(x, h, f, row_parallel=False, bias=True)
        second = _linear(x, f, h, row_parallel=True, bias=True)
        return join_parts(first, gelu, second, PartOps((), (), 2 * act))
    swiglu = PartOps(  # runtime.model._SwiGlu, on every device
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
    return join_parts(first, swiglu, second)


def _residual(x: LayerDims) -> PartOps:
    """x + block(norm(x)): the add, and backward the sum of x's two gradients (through the
    block and straight through). It keeps nothing."""
    act = x.bytes(x.hidden)
    return PartOps((memory("add", 2 * act, act),), (memory("add", 2 * act, act),), 0)


@memoized
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
    x = LayerDims(
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
        layer = megatron_gpt_layer(x, model.arch)
    elif x.sequence_parallel:
        norm, residual = _norm_on_shard(x), _residual(x.shard)
        layer = join_parts(norm, _attention(x), residual, norm, _mlp(x), residual)
    else:
        layer = join_parts(_norm(x), _attention(x), _residual(x), _norm(x), _mlp(x), _residual(x))
    if recompute is Recompute.FULL:
        return LayerOps(layer.forward, layer.forward + layer.backward, 0)
    if recompute is Recompute.SELECTIVE:
        return _selective(x, layer)
    return LayerOps(layer.forward, layer.backward, layer.saved)
