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


@functools.lru_cache(maxsize=16)
def parameter_table(spec: ModelSpec) -> Mapping[str, Parameter]:
    """Every full-model parameter of ``spec`` by name, in the model's order (embedding, layers,
    head). Made once per model and read-only: every stage's list and every rank's sync read it."""
    h, d, f = spec.hidden, spec.head_dim, spec.ffn_hidden
    gpt = spec.arch == "gpt"
    table: dict[str, Parameter] = {}

    def add(name, shape, owner, tp_dim, init, layer=None, scale=1.0) -> None:
        table[name] = Parameter(name, tuple(shape), owner, layer, tp_dim, init, scale)

    add("embed.weight", (spec.vocab, h), Owner.EMBEDDING, 0, Init.NORMAL)
    if gpt:
        add("pos.weight", (spec.seq_len, h), Owner.EMBEDDING, None, Init.NORMAL)
    linears = {"q": (spec.heads * d, h), "k": (spec.kv_heads * d, h), "v": (spec.kv_heads * d, h)}
    linears["o"] = (h, h)
    mlp = {"fc1": (f, h), "fc2": (h, f)} if gpt else {"gate": (f, h), "up": (f, h), "down": (h, f)}
    linears.update(mlp)
    # Output projections scaled down with depth (GPT-2), so deep models start stable.
    row_scale = 1 / math.sqrt(2 * spec.layers)
    for i in range(spec.layers):
        for norm in ("norm1", "norm2"):
            add(f"layers.{i}.{norm}.weight", (h,), Owner.LAYER, None, Init.ONES, i)
            if gpt:
                add(f"layers.{i}.{norm}.bias", (h,), Owner.LAYER, None, Init.ZEROS, i)
        for kind, shape in linears.items():
            row = kind in ROW
            scale = row_scale if row else 1.0
            add(
                f"layers.{i}.{kind}.weight",
                shape,
                Owner.LAYER,
                1 if row else 0,
                Init.NORMAL,
                i,
                scale,
            )
            if gpt:  # a row-parallel bias is added once, after the reduction: whole everywhere
                add(
                    f"layers.{i}.{kind}.bias",
                    shape[:1],
                    Owner.LAYER,
                    None if row else 0,
                    Init.ZEROS,
                    i,
                )
    add("final_norm.weight", (h,), Owner.HEAD, None, Init.ONES)
    if gpt:
        add("final_norm.bias", (h,), Owner.HEAD, None, Init.ZEROS)
    else:
        add("head.weight", (spec.vocab, h), Owner.HEAD, 0, Init.NORMAL)
    return MappingProxyType(table)


def stage_parameters(
    spec: ModelSpec, first: int, count: int, *, is_first: bool, is_last: bool
) -> list[str]:
    """The full-model names of the parameters a stage holds (a TP shard of each): its layers',
    the embedding's on the first stage, the head's on the last. GPT's last stage without the
    embedding holds a copy of ``embed.weight`` as its tied output projection."""

    def holds(param: Parameter) -> bool:
        if param.owner is Owner.LAYER:
            return first <= param.layer < first + count
        return is_first if param.owner is Owner.EMBEDDING else is_last

    names = [name for name, param in parameter_table(spec).items() if holds(param)]
    if is_last and spec.arch == "gpt" and not is_first:
        names.append("embed.weight")
    return names
