"""Memory of one device of a pipeline stage at the peak of a step.

bf16 mixed precision with Adam (Megatron-LM's layout): bf16 weights (2 bytes per parameter), fp32
main gradients (4), fp32 master weights (4) and two fp32 Adam moments (8): 18 bytes. fp32:
weights (4), gradients (4) and the two moments (8), no master copy: 16 bytes. A sharded optimizer
(Megatron's distributed optimizer) splits the optimizer's part (master weights and moments) over
the d data-parallel ranks holding the same parameters: 6 + 12 / d bytes in bf16, 8 + 8 / d in
fp32 (the ranks step their shard of the fp32 weights themselves, no copy of it); these bytes are
spec.plan.Precision's. Activations follow Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models"), for the micro-batches a stage holds at once under
its schedule.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from hethub.predictor.stage import StagePosition
from hethub.spec.layer_ops import Kernels, layer_ops
from hethub.spec.model import ModelSpec
from hethub.spec.parameters import stage_parameter_count
from hethub.spec.plan import Precision, Recompute
from hethub.spec.schedules import Schedule, in_flight_micro_batches

GB = 1e9


def state_bytes(precision: Precision) -> tuple[int, int, float]:
    """(weight, gradient, optimizer) bytes per parameter under ``precision``, unsharded."""
    return precision.weight_bytes, precision.main_grad_bytes, precision.optimizer_bytes(1)


@dataclass(frozen=True, slots=True)
class StageMemory:
    """GB on one device of a stage."""

    weights_gb: float
    grads_gb: float
    optimizer_gb: float
    activations_gb: float

    @property
    def total_gb(self) -> float:
        return self.weights_gb + self.grads_gb + self.optimizer_gb + self.activations_gb


@functools.lru_cache(maxsize=65536)
def stage_params(model: ModelSpec, layers: int, position: StagePosition) -> int:
    """Parameters of a stage (all TP ranks together), as spec.parameters lays them out."""
    return stage_parameter_count(model, layers, is_first=position.first, is_last=position.last)


def layer_activation_bytes(
    model: ModelSpec,
    tp: int,
    micro_batch: int,
    precision: Precision,
    kernels: Kernels = Kernels.FUSED,
) -> float:
    """Activations one layer keeps for its backward, one micro-batch, no recomputation: what
    spec.layer_ops says the runtime's layer saves on ``kernels`` (an accelerator's unless told:
    a CPU's RMSNorm keeps fp32 copies besides)."""
    return float(layer_ops(model, tp, micro_batch, precision, kernels).saved_bytes)


def stage_memory(
    model: ModelSpec,
    layers: int,
    tp: int,
    position: int,
    stages: int,
    micro_batches: int,
    micro_batch: int,
    recompute: Recompute,
    schedule: Schedule,
    precision: Precision,
) -> StageMemory:
    """Peak memory of one device of the stage at ``position`` (0-based) of a pipeline."""
    in_flight = in_flight_micro_batches(schedule, position, stages, micro_batches)
    return stage_memory_at(
        model,
        layers,
        tp,
        StagePosition.of(position, stages),
        in_flight,
        micro_batch,
        recompute,
        precision,
    )


def activation_bytes(
    model: ModelSpec,
    *,
    per_layer: float,
    bytes_per_element: int,
    layers: int,
    tp: int,
    last: bool,
    in_flight: float,
    micro_batch: int,
    recompute: Recompute,
    precision: Precision,
) -> float:
    """Activations a stage's device holds at its peak, from one layer's (``per_layer`` bytes)
    and ``bytes_per_element`` of a layer's input."""
    if recompute == Recompute.FULL:
        # Only each layer's input survives the forward; one layer's activations are rebuilt at a
        # time.
        layer_input = micro_batch * model.seq_len * model.hidden * bytes_per_element
        activations = in_flight * layers * layer_input + per_layer
    else:
        activations = in_flight * layers * per_layer
    if last:  # fp32 logits and their gradient, one micro-batch at a time
        activations += 2 * micro_batch * model.seq_len * model.vocab / tp * precision.loss_bytes
    return activations


@functools.lru_cache(maxsize=65536)
def stage_memory_at(
    model: ModelSpec,
    layers: int,
    tp: int,
    position: StagePosition,
    in_flight: float,
    micro_batch: int,
    recompute: Recompute,
    precision: Precision,
    optimizer_shards: int = 1,
) -> StageMemory:
    """Peak memory of one device of a stage holding ``in_flight`` micro-batches' activations,
    its optimizer state split over ``optimizer_shards`` ranks (a sharded optimizer)."""
    params = stage_params(model, layers, position) / tp
    activations = activation_bytes(
        model,
        per_layer=layer_activation_bytes(model, tp, micro_batch, precision),
        bytes_per_element=precision.element_bytes,
        layers=layers,
        tp=tp,
        last=position.last,
        in_flight=in_flight,
        micro_batch=micro_batch,
        recompute=recompute,
        precision=precision,
    )
    return StageMemory(
        params * precision.weight_bytes / GB,
        params * precision.main_grad_bytes / GB,
        params * precision.optimizer_bytes(optimizer_shards) / GB,
        activations / GB,
    )
