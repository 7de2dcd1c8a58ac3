"""Memory of one device of a pipeline stage at the peak of a step: what the runtime holds
(benchmarks/memory_vs_runtime.py and tests/test_memory_vs_runtime.py count it, live).

The state, kept across steps (spec.plan.Precision's bytes per parameter): the weights the stage
computes with, the fp32 main gradients, and the optimizer's: both fp32 Adam moments and bf16's
fp32 masters, split over the d ranks of a sharded optimizer (18 bytes a parameter in bf16, 16
in fp32; sharded, 6 + 12 / d and 8 + 8 / d). Autograd's own gradients of a backward live only
until its end, when the main gradients take them (runtime.precision): the buffers' moment.

Above it, the schedule's peak: what the layers keep for their backward (layer_activation_bytes)
for the micro-batches in flight under the stage's own recomputation: under selective, less the
attention's log-sum-exp (selective_saving_bytes); under full, each layer's input and one rebuilt
layer (the runtime checkpoints each layer on its own); the
stage's boundary tensors; and the highest moment of a backward: the last stage's loss, head and
final norm (loss_bytes), a layer's MLP. The optimizer step adds nothing (StageMemory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hethub.memo import memoized
from hethub.predictor.stage import StagePosition, StageShape
from hethub.spec.accelerator import AcceleratorSpec
from hethub.spec.layer_ops import layer_ops
from hethub.spec.model import ModelSpec
from hethub.spec.ops import Kernels
from hethub.spec.parameters import parameter_counts, parameter_table, stage_parameter_count
from hethub.spec.plan import FP32_BYTES, Precision, Recompute
from hethub.spec.schedules import (
    Schedule,
    chunks_per_stage,
    in_flight_micro_batches,
    model_chunk,
)

GB = 1e9


def state_bytes(precision: Precision) -> tuple[int, int, float]:
    """(weight, gradient, optimizer) bytes per parameter under ``precision``, unsharded."""
    return precision.weight_bytes, precision.main_grad_bytes, precision.optimizer_bytes(1)


@dataclass(frozen=True, slots=True)
class StageMemory:
    """GB on one device of a stage at the peak of a step: the state it keeps across steps and,
    above it, the schedule's peak. The optimizer step, after the schedule has freed its tensors,
    holds nothing above the state: fused AdamW steps the flat buffers in place, and bf16's copy
    back and a sharded optimizer's all-gather write into the weights' own buffer
    (runtime.optimizer; benchmarks/memory_vs_runtime.py measures it)."""

    weights_gb: float
    """The weights the stage computes with."""
    grads_gb: float
    """The fp32 main gradients."""
    optimizer_gb: float
    """The Adam moments and bf16's fp32 master weights, on this rank (a sharded optimizer's
    share)."""
    activations_gb: float
    """What the layers keep for their backward at the schedule's peak (layers_bytes)."""
    buffers_gb: float = 0.0
    """The rest of the schedule's peak (buffer_bytes): the stage's boundary tensors, the last
    stage's final norm, logits and loss buffers, and the gradients of the backward under way."""

    @property
    def state_gb(self) -> float:
        """What the stage keeps across steps."""
        return self.weights_gb + self.grads_gb + self.optimizer_gb

    @property
    def schedule_gb(self) -> float:
        """Above the state at the schedule's peak."""
        return self.activations_gb + self.buffers_gb

    @property
    def total_gb(self) -> float:
        return self.state_gb + self.schedule_gb


def headroom_gb(memory: StageMemory | float, device: AcceleratorSpec) -> float:
    """What ``device`` has left beside ``memory`` (a stage's, or its GB): its usable memory
    (AcceleratorSpec.usable_memory_gb: the runtime's reserve kept) less the stage's; negative
    where the stage does not fit."""
    need = memory.total_gb if isinstance(memory, StageMemory) else memory
    return device.usable_memory_gb - need


def fits(memory: StageMemory | float, device: AcceleratorSpec) -> bool:
    """Whether a stage's ``memory`` fits one ``device``: the one answer the predictor, the
    planner, the pre-flight and the dry run give."""
    return device.holds(memory.total_gb if isinstance(memory, StageMemory) else memory)


@memoized
def stage_params(model: ModelSpec, layers: int, position: StagePosition) -> int:
    """Parameters of a stage (all TP ranks together), as spec.parameters lays them out."""
    return stage_parameter_count(model, layers, is_first=position.first, is_last=position.last)


def layer_activation_bytes(
    model: ModelSpec,
    tp: int,
    micro_batch: int,
    precision: Precision,
    kernels: Kernels = Kernels.FUSED,
    sequence_parallel: bool = False,
) -> float:
    """Activations one layer keeps for its backward, one micro-batch, no recomputation: what
    spec.layer_ops says the runtime's layer saves on ``kernels`` (an accelerator's unless told:
    a CPU's RMSNorm keeps fp32 copies besides), sequence-parallel where told."""
    ops = layer_ops(model, tp, micro_batch, precision, kernels, sequence_parallel=sequence_parallel)
    return float(ops.saved_bytes)


def selective_saving_bytes(
    model: ModelSpec, tp: int, micro_batch: int, precision: Precision, kernels: Kernels
) -> float:
    """What one layer no longer keeps for its backward, one micro-batch, under selective
    recomputation (spec.layer_ops: with a flash kernel, only its log-sum-exp)."""
    kept = [
        layer_ops(model, tp, micro_batch, precision, kernels, recompute).saved_bytes
        for recompute in (Recompute.NONE, Recompute.SELECTIVE)
    ]
    return float(kept[0] - kept[1])


def stage_memory(
    model: ModelSpec,
    *,
    layers: int,
    tp: int,
    stage: int,
    stages: int,
    micro_batches: int,
    micro_batch: int,
    recompute: Recompute,
    schedule: Schedule,
    precision: Precision,
) -> StageMemory:
    """Peak memory of one device of stage ``stage`` (0-based) of a pipeline of ``stages``
    under ``schedule``, ``micro_batches`` of ``micro_batch`` sequences a step."""
    in_flight = in_flight_micro_batches(schedule, stage, stages, micro_batches)
    where = stage_position(schedule, stage, stages)
    shape = StageShape(model, layers, tp, where, micro_batch, recompute, precision)
    return stage_memory_at(shape, in_flight)


def stage_position(schedule: Schedule, stage: int, stages: int) -> StagePosition:
    """Where ``stage`` of ``stages`` sits, by the model chunks it holds under ``schedule``
    (spec.schedules.model_chunk): the first holds the embedding, the last the head; under ZBV's
    V the first stage holds both and the last neither."""
    chunks = chunks_per_stage(schedule) or 1  # interleaved: the ends are the same at any count
    held = {model_chunk(schedule, stage, stages, c) for c in range(chunks)}
    first, last = 0 in held, stages * chunks - 1 in held
    if first and last:
        return StagePosition.of(0, 1)
    return StagePosition.of(0 if first else 2 if last else 1, 3)


def layers_bytes(
    model: ModelSpec,
    *,
    per_layer: float,
    bytes_per_element: int,
    layers: int,
    in_flight: float,
    micro_batch: int,
    recompute: Recompute,
    split: int = 1,
) -> float:
    """What a stage's layers keep for their backward at the schedule's peak, from what one
    layer keeps for one micro-batch (``per_layer`` bytes); ``split``: the ranks a layer's input
    is split over along the sequence (sequence parallelism's tp, else 1)."""
    if recompute == Recompute.FULL:
        # The runtime checkpoints each layer on its own (runtime.model.Stage): a micro-batch in
        # flight keeps each layer's input (the first's: a received activation, or the first
        # stage's embedding output), and a backward rebuilds one layer at a time, whose
        # activations include its input, held already.
        layer_input = layer_input_bytes(model, micro_batch, bytes_per_element) / split
        return in_flight * layers * layer_input + rebuilt_layer_bytes(per_layer, layer_input)
    return in_flight * layers * per_layer


def layer_input_bytes(model: ModelSpec, micro_batch: int, bytes_per_element: int) -> float:
    """A layer's input (or output), one micro-batch: the hidden states a stage sends, and what
    a checkpointed layer keeps."""
    return micro_batch * model.seq_len * model.hidden * bytes_per_element


def rebuilt_layer_bytes(per_layer: float, layer_input: float) -> float:
    """Under full recomputation, what a backward holds above the layers' inputs: one layer's
    rebuilt activations, less its input (kept by its checkpoint)."""
    return per_layer - layer_input


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
    """The layers' activations at the schedule's peak (layers_bytes) and, on the last stage, its
    loss's (loss_bytes)."""
    held = layers_bytes(
        model,
        per_layer=per_layer,
        bytes_per_element=bytes_per_element,
        layers=layers,
        in_flight=in_flight,
        micro_batch=micro_batch,
        recompute=recompute,
    )
    return held + (loss_bytes(model, tp, micro_batch, precision) if last else 0)


def _norm_bytes(
    model: ModelSpec, tokens: int, precision: Precision, kernels: Kernels
) -> tuple[float, float]:
    """(kept, backward) bytes of one of the model's norms over ``tokens`` rows: what its forward
    keeps for its backward, its output included (the next GEMM keeps it), as spec.layer_ops
    counts a layer's norms; what its backward holds at once besides. One kernel each way
    (LayerNorm; RMSNorm on an accelerator): it keeps its input and per-row statistics (fp32; in
    the input's dtype for LayerNorm on the CPU), and its backward makes the input's gradient.
    RMSNorm on the CPU (runtime.model.RMSNorm) keeps what the fused kernel keeps, and its
    backward, in fp32, holds two fp32 (tokens, h) tensors at once (the normalised input, made
    into the input's gradient in place, and its product with the output's gradient)."""
    rows = tokens * model.hidden
    element = precision.element_bytes
    cpu = kernels is Kernels.CPU
    stats = (2 if model.arch == "gpt" else 1) * tokens
    stat_bytes = element if cpu and model.arch == "gpt" else FP32_BYTES
    backward = 2 * rows * FP32_BYTES if cpu and model.arch == "llama" else rows * element
    return rows * 2 * element + stats * stat_bytes, backward


def loss_bytes(
    model: ModelSpec,
    tp: int,
    micro_batch: int,
    precision: Precision,
    *,
    rebuilt: float | None = None,
    kernels: Kernels = Kernels.FUSED,
) -> float:
    """The last stage's peak above its layers' activations, one micro-batch in its backward: the
    highest of its moments (_LastStageMoments). ``rebuilt``: under full recomputation, the
    bytes a backward rebuilds above the layers' inputs (one layer's: rebuilt_layer_bytes);
    ``kernels``: the device's (spec.layer_ops)."""
    moments = _LastStageMoments.of(model, tp, micro_batch, precision, kernels)
    loss = moments.loss
    if rebuilt is not None:
        # The loss's backward runs before any layer is rebuilt (the final norm, the head and
        # the loss are not checkpointed: they keep what they keep without recomputation).
        loss -= rebuilt
    return max(loss, moments.head, moments.final_norm, moments.layer)


@dataclass(frozen=True, slots=True)
class _LastStageMoments:
    """What the last stage holds besides its layers' activations at each moment of a
    micro-batch's backward: through its loss, head and final norm, then through its layers
    (runtime.tensor_parallel's loss, runtime.model.Stage). The logits (N, V/tp) live only as
    long as the loss keeps them: the pipeline drops them once the loss is made
    (runtime.pipeline), so F.cross_entropy's (fp32, TP 1) go at once, the vocabulary-parallel
    loss's with its backward."""

    norm_kept: float
    loss: float
    head: float
    final_norm: float
    layer: float

    @classmethod
    def of(
        cls, model: ModelSpec, tp: int, micro_batch: int, precision: Precision, kernels: Kernels
    ) -> _LastStageMoments:
        tokens = micro_batch * model.seq_len
        element, vocab = precision.element_bytes, model.vocab / tp
        logits = tokens * vocab * element
        hidden = tokens * model.hidden * element
        norm_kept, norm_backward = _norm_bytes(model, tokens, precision, kernels)
        if tp == 1 and element == FP32_BYTES:
            # F.cross_entropy: it keeps the fp32 log-softmax, not the logits; its backward
            # makes the gradient of the log-probabilities, then that of the logits.
            loss = 3 * logits
        else:
            # _VocabParallelCrossEntropy keeps the logits and each row's fp32 log-sum-exp; its
            # backward makes the fp32 softmax, then the gradient in the logits' dtype (the same
            # tensor in fp32).
            softmax = tokens * vocab * FP32_BYTES
            loss = logits + tokens * FP32_BYTES + softmax + (logits if element != FP32_BYTES else 0)
        # The head's backward: the logits' gradient, the head's weight gradient, the final
        # norm's output gradient.
        head = logits + vocab * model.hidden * element + hidden
        # The final norm's backward: of what it kept, its input is held to the end.
        norm_input = hidden
        # From the head's backward on, its weight's gradient is autograd's own tensor until the
        # backward's end, when the main gradients take it (runtime.precision: every backward in
        # bf16, a step's first in fp32).
        head_grad = vocab * model.hidden * element
        return cls(
            norm_kept=norm_kept,
            loss=norm_kept + loss,
            head=norm_kept + head,
            final_norm=norm_input + norm_backward + head_grad,
            layer=_layer_backward_bytes(model, tp, micro_batch, precision) + head_grad,
        )


def _layer_backward_bytes(
    model: ModelSpec, tp: int, micro_batch: int, precision: Precision
) -> float:
    """What a layer's backward holds at its peak besides the activations: the MLP's, whose
    output GEMM's input gradient and the two it makes of it (llama: the gate's and the up's
    outputs' gradients; gpt: GELU's input gradient), each (N, ffn/tp), while the layer's
    output gradient (N, h) is alive."""
    tokens = micro_batch * model.seq_len
    ffn = tokens * model.ffn_hidden / tp * precision.element_bytes
    return 2 * ffn + tokens * model.hidden * precision.element_bytes


def late_backward_bytes(
    shape: StageShape, *, per_layer: float, params: float, in_flight: float
) -> float:
    """What a stage holds above its state as a micro-batch's backward reaches its first layer:
    the other micro-batches in flight (each its layers' activations, or under full
    recomputation their inputs), that layer's activations and backward peak, autograd's
    gradients of the stage's ``params`` (this rank's) in the weights' dtype, and the boundary
    tensors (the outputs sent; the last stage sends none, and its loss's tensors are gone by
    then; under sequence parallelism this rank's shards)."""
    model, layers, tp, position = shape.model, shape.layers, shape.tp, shape.position
    micro_batch, recompute, precision = shape.micro_batch, shape.recompute, shape.precision
    split = _sequence_split(shape)
    layer_input = layer_input_bytes(model, micro_batch, precision.element_bytes)
    one = layers * (layer_input / split if recompute == Recompute.FULL else per_layer)
    others = (in_flight - 1) * one
    boundary = 0.0 if position.last else in_flight * layer_input / split
    # At the first layer's backward peak (its MLP's), the gradients of its attention half and
    # of the first stage's embedding are still to come; the last to come, when the layer's
    # activations are freed, leave its input's gradient beside every other.
    embedding = (
        stage_parameter_count(model, 0, is_first=True, is_last=False) / tp if position.first else 0
    )
    grads = params * precision.weight_bytes
    first_layer = (
        per_layer
        + _layer_backward_bytes(model, tp, micro_batch, precision)
        + grads
        - (embedding + _attention_parameters(model, tp)) * precision.weight_bytes
        if layers
        else 0.0
    )
    end = grads + layer_input
    if position.first and position.last:
        # A tied head is the embedding's weight (runtime.model.Stage): the head's gradient,
        # made first, waits in autograd's buffer while the embedding's backward makes
        # its own (beside its output's gradient), and the engine then sums the two into a third.
        tied = parameter_counts(model).tied_copy / tp * precision.weight_bytes
        end = grads + tied + max(layer_input, tied)
    return others + boundary + max(first_layer, end)


@memoized
def _attention_parameters(model: ModelSpec, tp: int) -> int:
    """One rank's parameters of a layer's attention half: its first norm, QKV and output
    projection (spec.parameters' layer table)."""
    return sum(
        math.prod(p.shard_shape(tp))
        for name, p in parameter_table(model).items()
        if p.layer == 0 and name.split(".")[2] in _ATTENTION_PARTS
    )


_ATTENTION_PARTS = ("norm1", "qkv", "o")


def buffer_bytes(shape: StageShape, in_flight: float, *, rebuilt: float, kernels: Kernels) -> float:
    """What a stage of ``shape`` holds at the schedule's peak besides its layers' activations
    and its state: its boundary tensors for the ``in_flight`` micro-batches (runtime.pipeline;
    under sequence parallelism this rank's token shards) and the peak of a backward (the last
    stage's loss, head and final norm: loss_bytes; a layer's: _layer_backward_bytes).
    ``rebuilt``: under full recomputation, what a backward rebuilds above the layers' inputs
    (rebuilt_layer_bytes)."""
    model, tp, position = shape.model, shape.tp, shape.position
    micro_batch, recompute, precision = shape.micro_batch, shape.recompute, shape.precision
    split = _sequence_split(shape)
    hidden = layer_input_bytes(model, micro_batch, precision.element_bytes)
    boundary = 0.0
    if position.last:
        full = recompute == Recompute.FULL
        return boundary + loss_bytes(
            model, tp, micro_batch, precision, rebuilt=rebuilt if full else None, kernels=kernels
        )
    # The outputs sent, kept until their backward, and the gradient received for the backward
    # under way (its layer's output gradient).
    boundary += in_flight * hidden / split
    return boundary + _layer_backward_bytes(model, tp, micro_batch, precision)


@memoized
def stage_memory_at(
    shape: StageShape,
    in_flight: float,
    optimizer_shards: int = 1,
    kernels: Kernels = Kernels.FUSED,
) -> StageMemory:
    """Peak memory of one device of a stage of ``shape`` holding ``in_flight`` micro-batches'
    activations, its optimizer state split over ``optimizer_shards`` ranks (a sharded
    optimizer), on a device of ``kernels`` (spec.layer_ops: compute.kernels_of its
    accelerator)."""
    layer = shape.layer
    per_layer = layer_activation_bytes(
        layer.model, layer.tp, layer.micro_batch, layer.precision, kernels, layer.sequence_parallel
    )
    return stage_memory_of(
        shape,
        per_layer=per_layer,
        in_flight=in_flight,
        optimizer_shards=optimizer_shards,
        kernels=kernels,
    )


def _sequence_split(shape: StageShape) -> int:
    """The ranks a layer's input is split over along the sequence: the stage's TP degree under
    sequence parallelism, else 1."""
    return shape.tp if shape.split_sequence else 1


def stage_memory_of(
    shape: StageShape,
    *,
    per_layer: float,
    in_flight: float,
    optimizer_shards: int = 1,
    kernels: Kernels = Kernels.FUSED,
) -> StageMemory:
    """stage_memory_at's, from what one layer keeps for its backward, one micro-batch, without
    recomputation (``per_layer`` bytes: layer_activation_bytes, or a profile's measure)."""
    model, layers, tp, position = shape.model, shape.layers, shape.tp, shape.position
    micro_batch, recompute, precision = shape.micro_batch, shape.recompute, shape.precision
    params = stage_params(model, layers, position) / tp
    if recompute is Recompute.SELECTIVE:
        # A layer then keeps less and is otherwise held as without recomputation: its attention's
        # rebuilt inner part lives only while the backward is past the MLP, whose activations,
        # larger, are freed by then.
        per_layer -= selective_saving_bytes(model, tp, micro_batch, precision, kernels)
    split = _sequence_split(shape)
    activations = layers_bytes(
        model,
        per_layer=per_layer,
        bytes_per_element=precision.element_bytes,
        layers=layers,
        in_flight=in_flight,
        micro_batch=micro_batch,
        recompute=recompute,
        split=split,
    )
    rebuilt = rebuilt_layer_bytes(
        per_layer, layer_input_bytes(model, micro_batch, precision.element_bytes) / split
    )
    buffers = buffer_bytes(shape, in_flight, rebuilt=rebuilt, kernels=kernels)
    # A backward's last moment may hold more: autograd's gradients of every parameter of the
    # stage, made during it, wait for its end to join the main gradients (runtime.precision),
    # while its first layer is still in its backward. Under full recomputation, where little
    # else is held, that is the peak.
    late = late_backward_bytes(shape, per_layer=per_layer, params=params, in_flight=in_flight)
    buffers = max(buffers, late - activations)
    return StageMemory(
        weights_gb=params * precision.weight_bytes / GB,
        grads_gb=params * precision.main_grad_bytes / GB,
        optimizer_gb=params * precision.optimizer_bytes(optimizer_shards) / GB,
        activations_gb=activations / GB,
        buffers_gb=buffers / GB,
    )
