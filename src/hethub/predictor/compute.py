"""Compute time of one micro-batch through a layer, the embedding and the head, on one device.

Each figure is the device's own (spec.accelerator.DeviceEfficiency, from microbenchmarks): a GEMM
takes its FLOPs at the device's sustained GEMM rate plus its bytes at its streaming memory rate
(a roofline, so a thin GEMM slows by its bytes per FLOP, not by a fitted ramp), the fused
attention kernel its FLOPs at the device's flash-attention rate, memory-bound operators (norms,
softmax, activations, dropout, residual adds) their bytes at the streaming rate, and the host a
launch per operator: a piece of work takes the larger of its host time and its device time.
Backward is twice the forward (input and weight gradients); full recomputation repeats the
forward inside the backward, selective recomputation the attention's inner part (spec.layer_ops).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from hethub.errors import HethubError
from hethub.memo import memoized
from hethub.predictor import comm
from hethub.predictor.calibration import Calibration
from hethub.predictor.stage import LayerShape
from hethub.spec.accelerator import AcceleratorSpec
from hethub.spec.cluster import DeviceGroup
from hethub.spec.layer_ops import layer_ops
from hethub.spec.model import ModelSpec
from hethub.spec.ops import ALL_REDUCE, Kernels, Op, OpKind, collective_bytes, trainer_bytes
from hethub.spec.parameters import parameter_counts
from hethub.spec.plan import Precision, Recompute


def peak_tflops(accelerator: AcceleratorSpec, precision: Precision) -> float:
    """Dense TFLOP/s the device's GEMMs run at under ``precision``."""
    if precision == Precision.BF16:
        return accelerator.bf16_tflops
    if accelerator.fp32_tflops is None:
        raise HethubError(missing_fp32(accelerator))
    return accelerator.fp32_tflops


def missing_fp32(accelerator: AcceleratorSpec) -> str:
    """The error for an fp32 plan on a device without an fp32 figure."""
    return (
        f"accelerator {accelerator.name!r} has no fp32_tflops, which an fp32 plan is priced "
        f"at: give the group an inline accelerator with fp32_tflops (dense FP32 TFLOP/s from "
        f"its datasheet), or use precision bf16"
    )


@dataclass(frozen=True, slots=True)
class WorkCost:
    """Seconds one micro-batch spends in a piece of the model on one device."""

    forward_s: float
    backward_s: float
    """Includes the recomputed forward when recomputation is on."""
    forward_flops: float
    """FLOPs the forward's GEMMs and attention kernel run on this device."""


def gemm_time(
    flops: float,
    bytes_moved: float,
    accelerator: AcceleratorSpec,
    cal: Calibration,
    precision: Precision,
) -> float:
    """One GEMM of ``flops`` that reads and writes ``bytes_moved``: its FLOPs at the device's
    sustained GEMM rate, its bytes at its streaming memory rate (a thin GEMM, like attention's
    per-head products over 64 or 128 channels, moves many bytes a FLOP and runs far below the
    GEMM rate: it reaches half of it where its bytes take as long as its FLOPs), and a fixed
    tail (its start and last partial wave of tiles)."""
    peak = peak_tflops(accelerator, precision)
    compute = flops / (peak * 1e12 * accelerator.efficiency.gemm_sustained)
    return compute + memory_time(bytes_moved, accelerator) + cal.matmul_ramp_us * 1e-6


def attention_time(
    flops: float, bytes_moved: float, accelerator: AcceleratorSpec, precision: Precision
) -> float:
    """The fused attention kernel (flash attention): its FLOPs at the device's measured
    flash-attention rate, which is well below its GEMM rate (softmax between the two products,
    the causal mask's partial tiles), and the q, k, v and output it moves."""
    peak = peak_tflops(accelerator, precision)
    compute = flops / (peak * 1e12 * accelerator.efficiency.attention_sustained)
    return compute + memory_time(bytes_moved, accelerator)


def memory_time(bytes_moved: float, accelerator: AcceleratorSpec) -> float:
    """A memory-bound operator's bytes at the device's streaming rate."""
    return bytes_moved / (accelerator.memory_bw_gb_s * 1e9 * accelerator.efficiency.memory)


def launch_time(operators: int, accelerator: AcceleratorSpec, cal: Calibration) -> float:
    """The host's time to dispatch and launch ``operators`` operators on the device."""
    return operators * (cal.dispatch_us + accelerator.efficiency.launch_us) * 1e-6


@memoized  # read for every stage of every prediction
def kernels_of(accelerator: AcceleratorSpec) -> Kernels:
    """The kernels torch runs a layer's norms and attention with on ``accelerator``."""
    return Kernels.of_vendor(accelerator.vendor)


def layer_gemms(model: ModelSpec, tp: int, micro_batch: int) -> list[tuple[float, int]]:
    """(forward FLOPs, narrowest dimension) of one layer's GEMMs on one of ``tp`` devices as
    model FLOPs count them (MFU): spec.layer_ops' GEMMs, and attention's two products over all
    seq^2 query-key pairs (Megatron-LM's and PaLM's convention), where the causal kernel that is
    priced computes only seq (seq + 1) / 2 of them."""
    ops = layer_ops(model, tp, micro_batch, Precision.BF16, Kernels.FUSED).forward
    gemms = [(float(op.flops), op.narrowest) for op in ops if op.kind is OpKind.GEMM]
    pairs = micro_batch * model.heads // tp * model.seq_len**2
    products = [(2.0 * pairs * model.head_dim, min(model.seq_len, model.head_dim))] * 2
    return gemms[:1] + products + gemms[1:]


def pass_time(
    ops: tuple[Op, ...],
    accelerator: AcceleratorSpec,
    cal: Calibration,
    precision: Precision,
    collective_s: Callable[[Op], float],
) -> float:
    """Seconds of one pass (forward or backward) over ``ops``: the larger of the host's time to
    launch them and the device's to run them, GEMMs and attention at the GEMM efficiency, the
    memory-bound operations by the bytes they move, each TP collective ``collective_s`` of it."""
    device = 0.0
    for op in ops:
        if op.kind is OpKind.MEMORY:
            device += memory_time(op.bytes_moved, accelerator)
        elif op.kind is OpKind.COLLECTIVE:
            device += collective_s(op)
        elif op.kind is OpKind.ATTENTION:
            device += attention_time(op.flops, op.bytes_moved, accelerator, precision)
        else:
            device += gemm_time(op.flops, op.bytes_moved, accelerator, cal, precision)
    return max(launch_time(len(ops), accelerator, cal), device)


@memoized
def layer_cost(
    layer: LayerShape,
    accelerator: AcceleratorSpec,
    cal: Calibration,
    tp_allreduce_s: float,
    kernels: Kernels | None = None,
    *,
    tp_group: DeviceGroup | None = None,
) -> WorkCost:
    """One transformer layer of ``layer``'s shape, one micro-batch, on one of its ``tp``
    devices: spec.layer_ops' inventory of the layer, priced pass by pass (pass_time). With full
    recomputation the backward runs the forward again first; with selective, the attention's
    rotations, v's copy and kernel (Megatron-LM's layer: its core attention). ``kernels``: the
    layer that ran (Kernels.MEGATRON_LM for Megatron-LM's runs); None, the runtime's on the
    device's own (kernels_of).

    Its TP collectives: each all-reduce ``tp_allreduce_s`` (the layer's are all of its (B, T, h)
    activation), or, on ``tp_group`` (needed under sequence parallelism, whose layer also
    all-reduces its norms' weight gradients), each priced on its own bytes (tp_collective_time).
    """
    model, tp, micro_batch, recompute, precision, sequence_parallel = layer
    kernels = kernels or kernels_of(accelerator)
    ops = layer_ops(
        model, tp, micro_batch, precision, kernels, recompute, sequence_parallel=sequence_parallel
    )
    if tp_group is None:
        if sequence_parallel and tp > 1:
            raise HethubError("a sequence-parallel layer is priced on its TP group: give tp_group")
        collective_s = functools.partial(_same_seconds, tp_allreduce_s)
    else:
        collective_s = functools.partial(tp_collective_time, tp=tp, group=tp_group, cal=cal)
    # The backward's weight gradients join the step's gradients at each micro-batch: bytes of
    # the trainer's, not of the layer's own operations (spec.layer_ops holds those to the
    # layer's trace).
    accumulate = memory_time(
        parameter_counts(model).layer / tp * trainer_bytes(kernels, precision).accumulation,
        accelerator,
    )
    return WorkCost(
        pass_time(ops.forward, accelerator, cal, precision, collective_s),
        pass_time(ops.backward, accelerator, cal, precision, collective_s) + accumulate,
        sum(op.flops for op in ops.forward),
    )


def selective_rerun_share(
    layer: LayerShape,
    accelerator: AcceleratorSpec,
    cal: Calibration,
    tp_allreduce_s: float,
    kernels: Kernels | None = None,
) -> float:
    """What selective recomputation adds to a layer's backward, as a share of the layer's
    forward, as layer_cost prices both (``layer``'s own recomputation aside): a measured
    forward times it prices the rerun from a profile (predictor.profiled), which measures a
    layer's times without it."""
    plain, selective = (
        layer_cost(layer._replace(recompute=r), accelerator, cal, tp_allreduce_s, kernels)
        for r in (Recompute.NONE, Recompute.SELECTIVE)
    )
    return (selective.backward_s - plain.backward_s) / plain.forward_s


def _same_seconds(seconds: float, _op: Op) -> float:
    return seconds


def tp_collective_time(op: Op, *, tp: int, group: DeviceGroup, cal: Calibration) -> float:
    """Seconds of the TP collective ``op`` over ``tp`` devices of ``group``: an all-reduce of
    its bytes, or an all-gather or reduce-scatter (sequence parallelism's) of them, half that
    (comm.group_all_gather_time)."""
    nbytes = collective_bytes(op)
    if op.name == ALL_REDUCE:
        return comm.group_allreduce_time(nbytes, tp, group, cal)
    return comm.group_all_gather_time(nbytes, tp, group, cal)


@memoized
def embedding_cost(
    model: ModelSpec,
    accelerator: AcceleratorSpec,
    cal: Calibration,
    tp: int,
    micro_batch: int,
    precision: Precision,
) -> WorkCost:
    """Token (and position) embedding lookup on the first stage; its backward scatters gradients."""
    tokens = micro_batch * model.seq_len
    element = precision.element_bytes
    bytes_moved = 2 * tokens * model.hidden * element * (2 if model.arch == "gpt" else 1)
    device = memory_time(bytes_moved, accelerator)
    host = launch_time(3, accelerator, cal)
    return WorkCost(max(host, device), max(2 * host, 2 * device), 0.0)


@memoized
def head_cost(
    model: ModelSpec,
    accelerator: AcceleratorSpec,
    cal: Calibration,
    tp: int,
    micro_batch: int,
    precision: Precision,
) -> WorkCost:
    """Final norm, vocabulary-parallel output GEMM and cross-entropy on the last stage."""
    tokens = micro_batch * model.seq_len
    flops = 2 * tokens * model.hidden * model.vocab / tp
    norm_bytes = 2 * tokens * model.hidden * precision.element_bytes
    # Cross-entropy: cast, max, exp-sum and gradient passes over the fp32 logit shard.
    loss_bytes = 4 * tokens * model.vocab / tp * precision.loss_bytes
    element = precision.element_bytes
    gemm_bytes = (tokens * model.hidden + model.hidden * model.vocab // tp) * element
    gemm_bytes += tokens * model.vocab // tp * element  # the logits
    gemm = gemm_time(flops, gemm_bytes, accelerator, cal, precision)
    device = gemm + memory_time(norm_bytes + loss_bytes, accelerator)
    host = launch_time(10, accelerator, cal)
    backward = max(2 * host, 2 * gemm + memory_time(2 * norm_bytes + loss_bytes, accelerator))
    return WorkCost(max(host, device), backward, flops)
