"""Megatron-LM's GPT layer (Kernels.MEGATRON_LM), not hethub's: the layer the measured A100
runs (measurements/a100) ran, described operation by operation as spec.layer_ops describes
hethub's, so that the predictor prices those runs as what ran (its unfused bias-dropout-add, its
fused or torch softmax, its core attention that writes the scores)."""

from __future__ import annotations

from hethub.errors import HethubError
from hethub.spec.ops import (
    FP32_BYTES,
    MASK_BYTES,
    Kernels,
    LayerDims,
    Op,
    OpKind,
    PartOps,
    gemm,
    join_parts,
    memory,
)


def batched_gemm(name: str, batch: int, rows: int, inner: int, cols: int, element: int) -> Op:
    """``batch`` products (rows x inner) @ (inner x cols) in one kernel (bmm, baddbmm)."""
    read = batch * (rows * inner + inner * cols) * element
    flops = 2 * batch * rows * inner * cols
    return Op(name, OpKind.GEMM, read, batch * rows * cols * element, flops, min(rows, inner, cols))


def _megatron_linear(
    x: LayerDims, inputs: int, outputs: int, *, row_parallel: bool, bias_in_gemm: bool
) -> PartOps:
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
    return PartOps(tuple(forward), tuple(backward), 0)


def _megatron_layer_norm(x: LayerDims) -> PartOps:
    """apex's fused LayerNorm, and the sum of the residual stream's two gradients after its
    backward. It keeps its input (its output is kept by the GEMM that reads it)."""
    h, e, act = x.hidden, x.element, x.bytes(x.hidden)
    stats = 2 * x.tokens * FP32_BYTES
    forward = (memory("fused_layer_norm", act + 2 * h * e, act + stats),)
    backward = (
        memory("fused_layer_norm_backward", 2 * act + stats + 2 * h * e, act + 2 * h * e),
        memory("add", 2 * act, act),
    )
    return PartOps(forward, backward, act + act)


def _bias_dropout_add(x: LayerDims) -> PartOps:
    """The fused residual + dropout(y + bias): it keeps only its mask. Backward: the mask
    applied to the gradient (the residual's gradient passes through as it is)."""
    h, e, act = x.hidden, x.element, x.bytes(x.hidden)
    mask = x.tokens * h * MASK_BYTES
    forward = (memory("bias_dropout_add", 2 * act + h * e, act + mask),)
    backward = (memory("bias_dropout_add_backward", act + mask, act),)
    return PartOps(forward, backward, mask)


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


def _megatron_softmax(x: LayerDims, scores: int) -> PartOps:
    """Megatron's causal softmax over ``scores`` bytes of scores: its fused kernel (the
    probabilities kept), or where that is not available (megatron_fused_softmax) torch's in fp32:
    the scores upcast, scaled (query-key layer scaling), masked in place, softmax, cast back;
    the fp32 probabilities kept, and the causal mask (one per sequence, a broadcast read)."""
    if megatron_fused_softmax(x.batch, x.heads, x.seq):
        return PartOps(
            (memory("scaled_upper_triang_masked_softmax", scores, scores),),
            (memory("scaled_upper_triang_masked_softmax_backward", 2 * scores, scores),),
            scores,
        )
    wide = scores // x.element * FP32_BYTES
    mask = x.batch * x.heads * x.seq * x.seq * MASK_BYTES
    return PartOps(
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


def megatron_core_attention(x: LayerDims) -> PartOps:
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
    return PartOps(forward, backward, 3 * width + softmax.saved + scores + mask + width)


def megatron_gpt_layer(x: LayerDims, arch: str) -> PartOps:
    """Megatron-LM's GPT layer (Kernels.MEGATRON_LM); the fc1 and fc2 inputs and the GELU's
    input are kept, the MLP's activation by the fused bias-GELU."""
    if not x.gpt:
        raise HethubError(
            f"kernels {Kernels.MEGATRON_LM.value!r} describe Megatron-LM's GPT layer (the measured "
            f"A100 runs'), not a {arch!r} layer: price a {arch!r} model with its device's kernels"
        )
    h, f, e = x.hidden, x.ffn, x.element
    fc1 = x.bytes(f)
    bias_gelu = PartOps(
        (memory("bias_gelu", fc1 + f * e, fc1),),
        (memory("bias_gelu_backward", 2 * fc1 + f * e, fc1),),
        fc1 + fc1,  # the GELU's input, and its output (fc2's input)
    )
    return join_parts(
        _megatron_layer_norm(x),
        _megatron_linear(x, h, x.q + 2 * x.kv, row_parallel=False, bias_in_gemm=True),
        megatron_core_attention(x),
        _megatron_linear(x, x.q, h, row_parallel=True, bias_in_gemm=False),
        _bias_dropout_add(x),
        _megatron_layer_norm(x),
        _megatron_linear(x, h, f, row_parallel=False, bias_in_gemm=False),
        bias_gelu,
        _megatron_linear(x, f, h, row_parallel=True, bias_in_gemm=False),
        _bias_dropout_add(x),
    )
