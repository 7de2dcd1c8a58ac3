"""How the zero-bubble schedules split a backward: B, the input's gradient (what the stage
before waits for), and W, the weights' gradients (run later, in the bubbles).

Every linear's backward is two GEMMs of its forward's FLOPs, one for its input's gradient and
one for its weight's; W is the second of each (spec.layer_ops' linears: the aten mm/addmm of
the forward; attention's products, batched, have no weight). So W's share of a layer's
backward is its linears' forward FLOPs over the backward's FLOPs (attention's backward and a
recomputed forward count on B's side): 45-48% for the preset models. The same share splits a
profile's measured backward, which is timed whole, and the analytic one; the embedding's and
the head's backward, on the first and last chunks, are split by the layers' share (the head's
own is one half, near it).

What W keeps alive until it runs is what the linears read: their inputs and their outputs'
gradients. weight_held_share measures it against what the forward keeps for the backward:
99.6-99.9% of it for the preset models, so spec.schedules counts a micro-batch's activations
as held whole from its forward until its W.
"""

from __future__ import annotations

from hethub.memo import memoized
from hethub.spec.layer_ops import layer_ops
from hethub.spec.model import ModelSpec
from hethub.spec.ops import Kernels, Op, OpKind
from hethub.spec.plan import Precision, Recompute

LINEAR_GEMMS = ("mm", "addmm")
"""A linear's GEMM, as spec.layer_ops names it (batched GEMMs are attention's products)."""


def _linears(ops: tuple[Op, ...]) -> list[Op]:
    return [op for op in ops if op.kind is OpKind.GEMM and op.name in LINEAR_GEMMS]


@memoized
def weight_gradient_share(
    model: ModelSpec,
    tp: int,
    micro_batch: int,
    precision: Precision,
    kernels: Kernels,
    recompute: Recompute = Recompute.NONE,
) -> float:
    """W's share of one layer's backward (recomputation included), by FLOPs: the weight
    gradients' GEMMs, each of its linear's forward FLOPs, over all the backward's FLOPs."""
    ops = layer_ops(model, tp, micro_batch, precision, kernels, recompute)
    weight = sum(op.flops for op in _linears(ops.forward))
    return weight / sum(op.flops for op in ops.backward)


def weight_held_share(
    model: ModelSpec, tp: int, micro_batch: int, precision: Precision, kernels: Kernels
) -> float:
    """What W reads, one layer and one micro-batch (each linear's input and its output's
    gradient), over what the forward keeps for the backward (spec.layer_ops' saved_bytes)."""
    ops = layer_ops(model, tp, micro_batch, precision, kernels)
    tokens, element = micro_batch * model.seq_len, precision.element_bytes
    held = 0
    for gemm in _linears(ops.forward):
        outputs = gemm.written // (tokens * element)  # its output: (tokens, outputs)
        inputs = gemm.flops // (2 * tokens * outputs)  # 2 x tokens x inputs x outputs FLOPs
        held += tokens * inputs * element + gemm.written
    return held / ops.saved_bytes


def split_backward(backward_s: float, share: float) -> tuple[float, float]:
    """(B, W) seconds of a backward of ``backward_s`` whose W takes ``share`` of it."""
    weight = backward_s * share
    return backward_s - weight, weight
