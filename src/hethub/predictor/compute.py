"""Compute time of one micro-batch through a layer, the embedding and the head, on one device.

GEMMs are priced by FLOPs at a size-dependent efficiency, memory-bound operators (norms, softmax,
activations, dropout, residual adds) by bytes over memory bandwidth, and the host by a launch
cost per operator: a piece of work takes the larger of its host time and its device time.
Backward is twice the forward (input and weight gradients); full recomputation repeats the
forward inside the backward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from hethub.errors import HethubError
from hethub.predictor.calibration import Calibration
from hethub.spec.accelerator import AcceleratorSpec
from hethub.spec.model import ModelSpec
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


# Operators launched per layer forward, as Megatron-LM's layers issue them (structure, not
# hardware): gpt: LayerNorm, QKV GEMM, 3 layout changes, scores GEMM, fused softmax, dropout,
# values GEMM, layout change, projection GEMM, bias-dropout-add, LayerNorm, fc1 GEMM, bias-GELU,
# fc2 GEMM, bias-dropout-add; llama: RMSNorm (3 kernels), QKV GEMM, 2 rotary, attention,
# projection GEMM, residual add, RMSNorm (3), gate/up GEMMs, SiLU-multiply, down GEMM, add.
FORWARD_OPS = {"gpt": 18, "llama": 17}
BACKWARD_OPS_PER_FORWARD_OP = 2


@dataclass(frozen=True, slots=True)
class WorkCost:
    """Seconds one micro-batch spends in a piece of the model on one device."""

    forward_s: float
    backward_s: float
    """Includes the recomputed forward when recomputation is on."""
    forward_flops: float
    """Model FLOPs of the forward on this device (the backward's are twice these)."""


def gemm_time(
    flops: float,
    narrowest: int,
    accelerator: AcceleratorSpec,
    cal: Calibration,
    precision: Precision,
) -> float:
    """One GEMM whose smallest dimension is ``narrowest``.

    Its efficiency rises with its narrowest dimension (thin GEMMs, like attention's per-head
    products over 64 or 128 channels, cannot fill the tensor cores): eff = max * d / (d + d_half);
    and every GEMM pays a fixed ramp (tile waves, launch on the device), so small ones run slow.
    """
    efficiency = cal.matmul_efficiency * narrowest / (narrowest + cal.matmul_half_dim)
    peak = peak_tflops(accelerator, precision)
    return flops / (peak * 1e12 * efficiency) + cal.matmul_ramp_us * 1e-6


def memory_time(bytes_moved: float, accelerator: AcceleratorSpec, cal: Calibration) -> float:
    return bytes_moved / (accelerator.memory_bw_gb_s * 1e9 * cal.memory_efficiency)


def layer_gemms(model: ModelSpec, tp: int, micro_batch: int) -> list[tuple[float, int]]:
    """(forward FLOPs, narrowest dimension) of each GEMM of one layer on one of ``tp`` devices."""
    b, s, h, f, d = micro_batch, model.seq_len, model.hidden, model.ffn_hidden, model.head_dim
    tokens = b * s
    qkv = (h + 2 * model.kv_hidden) // tp
    return [
        (2 * tokens * h * qkv, min(tokens, h, qkv)),  # QKV projection
        (2 * tokens * s * h / tp, min(s, d)),  # attention scores Q K^T, per head over d channels
        (2 * tokens * s * h / tp, min(s, d)),  # attention-weighted values
        (2 * tokens * h * h / tp, min(tokens, h // tp)),  # output projection
        *[(2 * tokens * h * f / tp, min(tokens, h, f // tp))] * model.mlp_matrices,  # MLP
    ]


def layer_memory_bytes(model: ModelSpec, tp: int, micro_batch: int, precision: Precision) -> float:
    """Bytes the memory-bound operators of one layer's forward move on one device.

    gpt materialises the attention scores (Megatron-LM's fused softmax and dropout); llama uses a
    fused (flash) attention kernel that never writes them to memory.
    """
    b, s, h, f = micro_batch, model.seq_len, model.hidden, model.ffn_hidden
    tokens = b * s
    if model.arch == "gpt":
        scores = b * model.heads * s * s / tp
        elements = (
            2 * tokens * h * 2  # two LayerNorms: read and write
            + 6 * tokens * h / tp  # Q, K, V layout changes
            + 4.5 * scores  # softmax read/write, dropout read/write and its mask
            + 2 * tokens * h / tp  # context layout change
            + 3 * tokens * h * 2  # two bias-dropout-adds
            + 2 * tokens * f / tp  # bias-GELU
        )
    else:
        elements = (
            2 * tokens * h * 2  # two RMSNorms
            + 2 * tokens * (h + model.kv_hidden) / tp  # rotary on Q and K
            + 3 * tokens * h * 2  # two residual adds
            + 3 * tokens * f / tp  # SiLU(gate) * up
        )
    return elements * precision.element_bytes


@functools.lru_cache(maxsize=65536)
def layer_cost(
    model: ModelSpec,
    accelerator: AcceleratorSpec,
    cal: Calibration,
    tp: int,
    micro_batch: int,
    recompute: Recompute,
    tp_allreduce_s: float,
    precision: Precision,
) -> WorkCost:
    """One transformer layer, one micro-batch, on one of ``tp`` devices.

    The host launches operators ahead of the device, so a layer takes the larger of its host time
    and its device time; the device time includes the layer's tensor-parallel all-reduces
    (Megatron's column/row-parallel pair: two forward, two backward, each ``tp_allreduce_s``).
    """
    gemms = layer_gemms(model, tp, micro_batch)
    gemm_s = sum(
        gemm_time(flops, narrowest, accelerator, cal, precision) for flops, narrowest in gemms
    )
    memory_s = memory_time(layer_memory_bytes(model, tp, micro_batch, precision), accelerator, cal)
    host_s = FORWARD_OPS[model.arch] * cal.launch_us * 1e-6
    forward = max(host_s, gemm_s + memory_s + 2 * tp_allreduce_s)
    # Backward: two GEMMs (input and weight gradient) per forward GEMM, twice the memory traffic.
    backward = max(
        BACKWARD_OPS_PER_FORWARD_OP * host_s, 2 * gemm_s + 2 * memory_s + 2 * tp_allreduce_s
    )
    if recompute == Recompute.FULL:
        backward += forward
    return WorkCost(forward, backward, sum(flops for flops, _ in gemms))


@functools.lru_cache(maxsize=65536)
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
    device = memory_time(bytes_moved, accelerator, cal)
    host = 3 * cal.launch_us * 1e-6
    return WorkCost(max(host, device), max(2 * host, 2 * device), 0.0)


@functools.lru_cache(maxsize=65536)
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
    narrowest = min(tokens, model.hidden, model.vocab // tp)
    gemm = gemm_time(flops, narrowest, accelerator, cal, precision)
    device = gemm + memory_time(norm_bytes + loss_bytes, accelerator, cal)
    host = 10 * cal.launch_us * 1e-6
    backward = max(2 * host, 2 * gemm + memory_time(2 * norm_bytes + loss_bytes, accelerator, cal))
    return WorkCost(max(host, device), backward, flops)
