"""The model's parameter layout: every full-model parameter, with its full shape, the part of the
model that owns it, the dimension tensor parallelism splits it along and how it starts.

One table read by everything that handles parameters: initialisation and sharding
(runtime.model), the gradient sync (runtime.engine) and checkpoints (runtime.checkpoint).
Full-model names are the checkpoint's keys, whatever the layout:

  embed.weight [vocab, h]; pos.weight [max_position_embeddings or seq, h] (gpt)
  layers.{i}.norm1 / norm2 (.weight, .bias for gpt)
  layers.{i}.qkv (.weight [kv, heads/kv + 2, d, h], .bias [kv, heads/kv + 2, d] where qkv_bias)
  layers.{i}.o (.weight [h, h], .bias [h] where o_bias)
  layers.{i}.gate_up (.weight [2, f, h], llama), layers.{i}.down (.weight [h, f], llama)
  layers.{i}.fc1 (.weight [f, h], .bias), layers.{i}.fc2 (.weight [h, f], .bias) (gpt)
  final_norm (.weight, .bias for gpt); head.weight [vocab, h] (absent where the head is tied to
  embed.weight: gpt's default, Llama 3.2's)

qkv_bias and o_bias default to the arch's (gpt yes, llama no; Qwen2 has qkv's only).

The fused projections, one GEMM each, keep their output features in blocks: qkv, per KV head
(Megatron-LM's grouped layout), its heads/kv query heads, then its key, then its value (with
heads == kv, GPT's: [heads, 3, d, h]); gate_up, the gate's rows then the up projection's. A
layer flattens the blocks into one weight. They were separate parameters (q, k, v; gate, up)
once: ``fused_parts`` says how those make these (checkpoints of then still load).

Megatron's split: column-parallel linears (qkv, gate_up, fc1) and the vocabulary (embedding, head)
are split over their output features, row-parallel linears (o, down, fc2) over their input
columns (dim 1); norms, positions and row-parallel biases are whole on every TP rank. The
blocks make the split exact on every TP degree with a plain contiguous slice: qkv is split over
its KV heads (dim 0), so a rank holds whole groups, each KV head with its own query heads;
gate_up over the ffn features (dim 1), so a rank holds the same gate and up rows, and the
full-model tensor is the same whatever the TP degree.
Pure Python: the predictor may read it too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

from hethub.memo import memoized
from hethub.spec.model import ModelSpec

INIT_STD = 0.02
ROW = ("o", "down", "fc2")  # split over input features (dim 1)


class Init(StrEnum):
    """How a parameter starts."""

    NORMAL = "normal"  # N(0, INIT_STD) times the parameter's scale
    ONES = "ones"
    ZEROS = "zeros"


class Owner(StrEnum):
    """The part of the model a parameter belongs to, which decides the stage that holds it."""

    EMBEDDING = "embedding"  # the first stage
    LAYER = "layer"  # the stage holding its layer
    HEAD = "head"  # the last stage (final norm and output projection)


@dataclass(frozen=True, slots=True)
class Parameter:
    """One full-model parameter."""

    name: str
    shape: tuple[int, ...]
    owner: Owner
    layer: int | None
    """Its transformer layer (Owner.LAYER only)."""
    tp_dim: int | None
    """The dimension TP splits it along into equal contiguous slices (None: whole on every rank)."""
    init: Init
    scale: float = 1.0

    def shard_shape(self, tp: int) -> tuple[int, ...]:
        """The shape one of ``tp`` ranks holds."""
        if self.tp_dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.tp_dim] //= tp
        return tuple(shape)


def _embedding(spec: ModelSpec) -> list[Parameter]:
    """The first stage's own parameters: the token embedding (and GPT's learned positions, one
    row for every position the model takes)."""
    embedding = [
        Parameter("embed.weight", (spec.vocab, spec.hidden), Owner.EMBEDDING, None, 0, Init.NORMAL)
    ]
    if spec.arch == "gpt":
        rows = spec.position_rows
        embedding.append(
            Parameter("pos.weight", (rows, spec.hidden), Owner.EMBEDDING, None, None, Init.NORMAL)
        )
    return embedding


def qkv_blocks(spec: ModelSpec) -> tuple[int, int, int]:
    """The fused QKV projection's output features as blocks (kv, heads/kv + 2, d): per KV head,
    its query heads, its key and its value."""
    return (spec.kv_heads, spec.heads // spec.kv_heads + 2, spec.head_dim)


def gate_up_blocks(spec: ModelSpec) -> tuple[int, int]:
    """The fused gate|up projection's output features as blocks (2, f): gate, then up."""
    return (2, spec.ffn_hidden)


def _linears(spec: ModelSpec) -> dict[str, tuple[tuple[int, ...], int]]:
    """A layer's linears: each weight's full shape (its output features, in blocks, then its
    input features) and the dimension TP splits it along."""
    h, f = spec.hidden, spec.ffn_hidden
    linears = {"qkv": ((*qkv_blocks(spec), h), 0), "o": ((h, h), 1)}
    if spec.arch == "gpt":
        linears.update(fc1=((f, h), 0), fc2=((h, f), 1))
    else:
        linears.update(gate_up=((*gate_up_blocks(spec), h), 1), down=((h, f), 1))
    return linears


def _biased(spec: ModelSpec) -> frozenset[str]:
    """The layer's linears that add a bias: GPT's MLP's always; qkv and o where the spec says."""
    biased = {"fc1", "fc2"} if spec.arch == "gpt" else set()
    biased |= {kind for kind, bias in (("qkv", spec.qkv_bias), ("o", spec.o_bias)) if bias}
    return frozenset(biased)


def _layer(spec: ModelSpec, i: int) -> list[Parameter]:
    """Transformer layer ``i``'s parameters: every layer has the same shapes."""
    h = spec.hidden
    gpt = spec.arch == "gpt"
    biased = _biased(spec)
    params = []
    for norm in ("norm1", "norm2"):
        params.append(Parameter(f"layers.{i}.{norm}.weight", (h,), Owner.LAYER, i, None, Init.ONES))
        if gpt:
            params.append(
                Parameter(f"layers.{i}.{norm}.bias", (h,), Owner.LAYER, i, None, Init.ZEROS)
            )
    # Output projections scaled down with depth (GPT-2), so deep models start stable.
    row_scale = 1 / math.sqrt(2 * spec.layers)
    for kind, (shape, tp_dim) in _linears(spec).items():
        row = kind in ROW
        params.append(
            Parameter(
                f"layers.{i}.{kind}.weight",
                shape,
                Owner.LAYER,
                i,
                tp_dim,
                Init.NORMAL,
                row_scale if row else 1.0,
            )
        )
        if kind in biased:  # a row-parallel bias is added once, after the reduction: whole
            params.append(
                Parameter(
                    f"layers.{i}.{kind}.bias",
                    shape[:-1],
                    Owner.LAYER,
                    i,
                    None if row else tp_dim,
                    Init.ZEROS,
                )
            )
    return params


@dataclass(frozen=True, slots=True)
class FusedParts:
    """How a fused parameter of a layer is made of the separate parameters a layer had before
    (and most trainers have): each part, in its own shape, viewed as the fused tensor's shape
    with ``sizes[j]`` along ``dim``, and the parts concatenated along ``dim``."""

    shape: tuple[int, ...]
    """The fused parameter's full shape."""
    names: tuple[str, ...]
    """The parts' names in a layer (``q.weight``), in the fused tensor's order."""
    shapes: tuple[tuple[int, ...], ...]
    """Each part's own full shape."""
    dim: int
    """The fused tensor's dimension the parts are concatenated along."""
    sizes: tuple[int, ...]
    """Each part's extent along ``dim``."""


@memoized
def fused_parts(spec: ModelSpec) -> Mapping[str, FusedParts]:
    """The fused parameters of a layer by their name in it (``qkv.weight``), with their parts:
    the table of renames from the layers before the fused GEMMs. Read-only."""
    h, d, f = spec.hidden, spec.head_dim, spec.ffn_hidden
    q, kv = spec.heads * d, spec.kv_heads * d
    queries = spec.heads // spec.kv_heads

    def qkv(suffix: str, features: tuple[int, ...]) -> FusedParts:
        names = tuple(f"{part}.{suffix}" for part in ("q", "k", "v"))
        shapes = tuple((n, *features) for n in (q, kv, kv))
        return FusedParts((*qkv_blocks(spec), *features), names, shapes, 1, (queries, 1, 1))

    parts = {"qkv.weight": qkv("weight", (h,))}
    if spec.qkv_bias:
        parts["qkv.bias"] = qkv("bias", ())
    if spec.arch == "llama":
        names, shapes = ("gate.weight", "up.weight"), ((f, h), (f, h))
        parts["gate_up.weight"] = FusedParts((*gate_up_blocks(spec), h), names, shapes, 0, (1, 1))
    return MappingProxyType(parts)


def _head(spec: ModelSpec) -> list[Parameter]:
    """The last stage's own parameters: the final norm, and the output projection unless it is
    tied to the embedding."""
    h = spec.hidden
    head = [Parameter("final_norm.weight", (h,), Owner.HEAD, None, None, Init.ONES)]
    if spec.arch == "gpt":
        head.append(Parameter("final_norm.bias", (h,), Owner.HEAD, None, None, Init.ZEROS))
    if not spec.tied_head:
        head.append(Parameter("head.weight", (spec.vocab, h), Owner.HEAD, None, 0, Init.NORMAL))
    return head


@memoized
def parameter_table(spec: ModelSpec) -> Mapping[str, Parameter]:
    """Every full-model parameter of ``spec`` by name, in the model's order (embedding, layers,
    head). Made once per model and read-only: every stage's list and every rank's sync read it."""
    layers = (param for i in range(spec.layers) for param in _layer(spec, i))
    return MappingProxyType(
        {param.name: param for param in (*_embedding(spec), *layers, *_head(spec))}
    )


def holds_tied_copy(spec: ModelSpec, *, is_first: bool, is_last: bool) -> bool:
    """A stage keeps its own copy of ``embed.weight`` as its tied output projection: the last
    stage without the embedding, where the head is tied (its gradient is summed with the
    embedding's)."""
    return is_last and not is_first and spec.tied_head


def stage_parameters(
    spec: ModelSpec, first: int, count: int, *, is_first: bool, is_last: bool
) -> list[str]:
    """The full-model names of the parameters a stage holds (a TP shard of each): its layers',
    the embedding's on the first stage, the head's on the last, and a tied copy of the
    embedding where holds_tied_copy says."""

    def holds(param: Parameter) -> bool:
        if param.owner is Owner.LAYER:
            return first <= param.layer < first + count
        return is_first if param.owner is Owner.EMBEDDING else is_last

    names = [name for name, param in parameter_table(spec).items() if holds(param)]
    if holds_tied_copy(spec, is_first=is_first, is_last=is_last):
        names.append("embed.weight")
    return names


@dataclass(frozen=True, slots=True)
class ParameterCounts:
    """Parameters of each part of the model (all TP ranks together), from the table's entries."""

    embedding: int
    """The first stage's own: the token embedding (and GPT's positions)."""
    layer: int
    """One transformer layer."""
    head: int
    """The last stage's own: the final norm (and an untied output projection)."""
    tied_copy: int
    """A stage's copy of the embedding as its tied output projection (holds_tied_copy)."""


@memoized
def parameter_counts(spec: ModelSpec) -> ParameterCounts:
    """The model's parameter counts by part: one layer's entries stand for every layer's, so a
    model of many layers is counted without its whole table."""

    def size(params: list[Parameter]) -> int:
        return sum(math.prod(param.shape) for param in params)

    embed = math.prod(_embedding(spec)[0].shape)
    return ParameterCounts(
        embedding=size(_embedding(spec)),
        layer=size(_layer(spec, 0)),
        head=size(_head(spec)),
        tied_copy=embed if spec.tied_head else 0,
    )


def parameter_count(spec: ModelSpec) -> int:
    """All parameters of the model (a tied copy not counted again)."""
    counts = parameter_counts(spec)
    return counts.embedding + spec.layers * counts.layer + counts.head


def stage_parameter_count(spec: ModelSpec, layers: int, *, is_first: bool, is_last: bool) -> int:
    """Parameters of a stage of ``layers`` layers (all TP ranks together): the count of
    stage_parameters' list."""
    counts = parameter_counts(spec)
    params = layers * counts.layer
    if is_first:
        params += counts.embedding
    if is_last:
        params += counts.head
    if holds_tied_copy(spec, is_first=is_first, is_last=is_last):
        params += counts.tied_copy
    return params
