"""The model's parameter layout: every full-model parameter, with its full shape, the part of the
model that owns it, the dimension tensor parallelism splits it along and how it starts.

One table read by everything that handles parameters: initialisation and sharding
(runtime.model), the gradient sync (runtime.engine) and checkpoints (runtime.checkpoint).
Full-model names are the checkpoint's keys, whatever the layout:

  embed.weight [vocab, h]; pos.weight [seq, h] (gpt)
  layers.{i}.norm1 / norm2 (.weight, .bias for gpt)
  layers.{i}.q / k / v (.weight [heads*d | kv*d, h], .bias for gpt)
  layers.{i}.o (.weight [h, h], .bias for gpt)
  layers.{i}.gate / up (.weight [f, h], llama), layers.{i}.down (.weight [h, f], llama)
  layers.{i}.fc1 (.weight [f, h], .bias), layers.{i}.fc2 (.weight [h, f], .bias) (gpt)
  final_norm (.weight, .bias for gpt); head.weight [vocab, h] (llama; gpt ties it to embed.weight)

Megatron's split: column-parallel linears (q, k, v, gate, up, fc1) and the vocabulary (embedding,
head) are split over their output rows (dim 0), row-parallel linears (o, down, fc2) over their
input columns (dim 1); norms, positions and row-parallel biases are whole on every TP rank.
Pure Python: the predictor may read it too.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

from hethub.spec.model import ModelSpec

INIT_STD = 0.02
COLUMN = ("q", "k", "v", "gate", "up", "fc1")  # split over output features (dim 0)
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
    """The first stage's own parameters: the token embedding (and GPT's learned positions)."""
    embedding = [
        Parameter("embed.weight", (spec.vocab, spec.hidden), Owner.EMBEDDING, None, 0, Init.NORMAL)
    ]
    if spec.arch == "gpt":
        embedding.append(
            Parameter(
                "pos.weight", (spec.seq_len, spec.hidden), Owner.EMBEDDING, None, None, Init.NORMAL
            )
        )
    return embedding


def _layer(spec: ModelSpec, i: int) -> list[Parameter]:
    """Transformer layer ``i``'s parameters: every layer has the same shapes."""
    h, d, f = spec.hidden, spec.head_dim, spec.ffn_hidden
    gpt = spec.arch == "gpt"
    params = []
    for norm in ("norm1", "norm2"):
        params.append(Parameter(f"layers.{i}.{norm}.weight", (h,), Owner.LAYER, i, None, Init.ONES))
        if gpt:
            params.append(
                Parameter(f"layers.{i}.{norm}.bias", (h,), Owner.LAYER, i, None, Init.ZEROS)
            )
    linears = {"q": (spec.heads * d, h), "k": (spec.kv_heads * d, h), "v": (spec.kv_heads * d, h)}
    linears["o"] = (h, h)
    mlp = {"fc1": (f, h), "fc2": (h, f)} if gpt else {"gate": (f, h), "up": (f, h), "down": (h, f)}
    linears.update(mlp)
    # Output projections scaled down with depth (GPT-2), so deep models start stable.
    row_scale = 1 / math.sqrt(2 * spec.layers)
    for kind, shape in linears.items():
        row = kind in ROW
        params.append(
            Parameter(
                f"layers.{i}.{kind}.weight",
                shape,
                Owner.LAYER,
                i,
                1 if row else 0,
                Init.NORMAL,
                row_scale if row else 1.0,
            )
        )
        if gpt:  # a row-parallel bias is added once, after the reduction: whole everywhere
            params.append(
                Parameter(
                    f"layers.{i}.{kind}.bias",
                    shape[:1],
                    Owner.LAYER,
                    i,
                    None if row else 0,
                    Init.ZEROS,
                )
            )
    return params


def _head(spec: ModelSpec) -> list[Parameter]:
    """The last stage's own parameters: the final norm, and Llama's output projection (GPT's is
    the embedding, tied)."""
    h = spec.hidden
    head = [Parameter("final_norm.weight", (h,), Owner.HEAD, None, None, Init.ONES)]
    if spec.arch == "gpt":
        head.append(Parameter("final_norm.bias", (h,), Owner.HEAD, None, None, Init.ZEROS))
    else:
        head.append(Parameter("head.weight", (spec.vocab, h), Owner.HEAD, None, 0, Init.NORMAL))
    return head


@functools.lru_cache(maxsize=16)
def parameter_table(spec: ModelSpec) -> Mapping[str, Parameter]:
    """Every full-model parameter of ``spec`` by name, in the model's order (embedding, layers,
    head). Made once per model and read-only: every stage's list and every rank's sync read it."""
    layers = (param for i in range(spec.layers) for param in _layer(spec, i))
    return MappingProxyType(
        {param.name: param for param in (*_embedding(spec), *layers, *_head(spec))}
    )


def holds_tied_copy(spec: ModelSpec, *, is_first: bool, is_last: bool) -> bool:
    """A stage keeps its own copy of ``embed.weight`` as its tied output projection: GPT's last
    stage without the embedding (its gradient is summed with the embedding's)."""
    return is_last and not is_first and spec.arch == "gpt"


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
    """The last stage's own: the final norm (and Llama's output projection)."""
    tied_copy: int
    """A stage's copy of the embedding as its tied output projection (holds_tied_copy)."""


@functools.lru_cache(maxsize=16)
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
        tied_copy=embed if spec.arch == "gpt" else 0,
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
