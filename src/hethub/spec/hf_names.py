"""hethub's full-model parameters as HuggingFace checkpoints name and lay them out, and back.

Every hethub parameter (spec.parameters' table) is made of one or more HF tensors ("parts"),
concatenated along one dimension of hethub's layout: the fused qkv of q_proj, k_proj and v_proj
(GPT-2: of the three thirds of c_attn), gate_up of gate_proj and up_proj, and every other
parameter of one tensor of its own. A part is described in the orientation of torch's
nn.Linear, ``[out_features, *in]`` ("rows" first); GPT-2's Conv1D weights are stored the other
way round, ``[in, out]``, and are ``transposed`` on the way in and out. Each part is hethub's
block ``view`` of some rows of its HF tensor: qkv's q part [kv, heads/kv, d, h] is q_proj's rows
in head order (query head j belongs to KV head j // (heads/kv), as HF's repeat_kv has it), its
k and v parts [kv, 1, d, h] k_proj's and v_proj's.

A TP shard of a hethub parameter is then a contiguous range of each part's rows (qkv split over
KV heads, gate_up, fc1, the embedding and the head over output features), or of its input
columns (o, down, fc2): ``part_slice`` gives it, so a rank reads only its own bytes of a file.
Pure Python (no torch): the names and shapes are data, the predictor may read them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from hethub.memo import memoized
from hethub.spec.model import ModelSpec
from hethub.spec.parameters import parameter_table

BASE_PREFIX = {"llama": "model.", "gpt": "transformer."}
"""The base model's prefix of each arch's HF names (base_model_prefix), which checkpoints of the
base model alone (GPT-2's own on the Hub) leave out."""
IGNORED_BUFFERS = (
    re.compile(r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias"),  # GPT-2's causal mask
    re.compile(r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq"),  # old Llamas' table
)
"""Tensors a HF checkpoint may hold that are no weights: buffers older transformers saved."""


@dataclass(frozen=True, slots=True)
class HfPart:
    """One HF tensor's share of a hethub parameter."""

    name: str
    """The HF tensor's name (with the base model's prefix)."""
    shape: tuple[int, ...]
    """Its shape in the file."""
    transposed: bool
    """Stored as [in, out] (GPT-2's Conv1D), not nn.Linear's [out, in]."""
    row_start: int
    """The first of its rows (output features) the part takes: c_attn's k third starts at h."""
    view: tuple[int, ...]
    """The part's shape in hethub's layout: its rows (``rows`` of them, from row_start) and
    input features, viewed as hethub's blocks."""

    @property
    def rows(self) -> int:
        """How many of the HF tensor's rows the part takes."""
        return math.prod(self.view) // math.prod(self.linear_shape[1:])

    @property
    def linear_shape(self) -> tuple[int, ...]:
        """The HF tensor's shape as nn.Linear lays it out: [out, *in]."""
        return tuple(reversed(self.shape)) if self.transposed else self.shape


@dataclass(frozen=True, slots=True)
class HfSource:
    """How a hethub parameter is made of HF tensors: its parts, concatenated along ``dim`` of
    hethub's layout (one part: the tensor itself)."""

    parts: tuple[HfPart, ...]
    dim: int


@dataclass(frozen=True, slots=True)
class PartSlice:
    """What a TP rank reads of a part: rows [row_start, row_stop) and, for a split along the
    input features, columns [col_start, col_stop) of the nn.Linear orientation (None: all), to
    be viewed as ``view`` (the part's shape in hethub's layout, this rank's extent)."""

    row_start: int
    row_stop: int
    cols: tuple[int, int] | None
    view: tuple[int, ...]


def part_slice(part: HfPart, tp_dim: int | None, rank: int, tp: int) -> PartSlice:
    """TP rank ``rank`` of ``tp``'s slice of ``part`` (of a parameter split along ``tp_dim`` of
    hethub's layout; None: whole)."""
    view = list(part.view)
    inputs = len(part.linear_shape) - 1  # the trailing input dimensions of the view
    leading = len(view) - inputs
    start, stop, cols = part.row_start, part.row_start + part.rows, None
    if tp_dim is not None and tp > 1:
        extent = view[tp_dim] // tp
        lo, hi = rank * extent, (rank + 1) * extent
        view[tp_dim] = extent
        if tp_dim < leading:  # a range of output features: rows, contiguous as the dims before
            # tp_dim are of size 1 in every part (qkv's KV heads come first; gate_up's parts
            # are one block each)
            per = math.prod(part.view[tp_dim + 1 : leading])
            start, stop = part.row_start + lo * per, part.row_start + hi * per
        else:  # a range of input features (a row-parallel linear's)
            cols = (lo, hi)
    return PartSlice(start, stop, cols, tuple(view))


def _linear(name: str, shape: tuple[int, ...], transposed: bool = False) -> HfSource:
    """A parameter that is one HF tensor whole (of hethub's ``shape``)."""
    stored = tuple(reversed(shape)) if transposed else shape
    return HfSource((HfPart(name, stored, transposed, 0, shape),), 0)


def _llama_layer(spec: ModelSpec, i: int) -> dict[str, HfSource]:
    h, d, f = spec.hidden, spec.head_dim, spec.ffn_hidden
    kv, queries = spec.kv_heads, spec.heads // spec.kv_heads
    at, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
    out = {
        f"layers.{i}.norm1.weight": _linear(f"model.layers.{i}.input_layernorm.weight", (h,)),
        f"layers.{i}.norm2.weight": _linear(
            f"model.layers.{i}.post_attention_layernorm.weight", (h,)
        ),
        f"layers.{i}.o.weight": _linear(f"{at}.o_proj.weight", (h, h)),
        f"layers.{i}.down.weight": _linear(f"{mlp}.down_proj.weight", (h, f)),
    }
    for suffix, features in (("weight", (h,)), ("bias", ())):
        if suffix == "bias" and not spec.qkv_bias:
            continue
        parts = tuple(
            HfPart(
                f"{at}.{proj}_proj.{suffix}", (n * d, *features), False, 0, (kv, size, d, *features)
            )
            for proj, n, size in (("q", spec.heads, queries), ("k", kv, 1), ("v", kv, 1))
        )
        out[f"layers.{i}.qkv.{suffix}"] = HfSource(parts, 1)
    if spec.o_bias:
        out[f"layers.{i}.o.bias"] = _linear(f"{at}.o_proj.bias", (h,))
    gate_up = tuple(
        HfPart(f"{mlp}.{proj}_proj.weight", (f, h), False, 0, (1, f, h)) for proj in ("gate", "up")
    )
    out[f"layers.{i}.gate_up.weight"] = HfSource(gate_up, 0)
    return out


def _gpt2_layer(spec: ModelSpec, i: int) -> dict[str, HfSource]:
    h, d, f = spec.hidden, spec.head_dim, spec.ffn_hidden
    block = f"transformer.h.{i}"
    out = {}
    for norm, ln in (("norm1", "ln_1"), ("norm2", "ln_2")):
        for suffix in ("weight", "bias"):
            out[f"layers.{i}.{norm}.{suffix}"] = _linear(f"{block}.{ln}.{suffix}", (h,))
    # c_attn: [h, 3h] on file (Conv1D), its output features q | k | v, each in head order
    for suffix, stored, features in (("weight", (h, 3 * h), (h,)), ("bias", (3 * h,), ())):
        parts = tuple(
            HfPart(
                f"{block}.attn.c_attn.{suffix}",
                stored,
                suffix == "weight",
                third * h,
                (spec.heads, 1, d, *features),
            )
            for third in range(3)
        )
        out[f"layers.{i}.qkv.{suffix}"] = HfSource(parts, 1)
    out[f"layers.{i}.o.weight"] = _linear(f"{block}.attn.c_proj.weight", (h, h), True)
    out[f"layers.{i}.o.bias"] = _linear(f"{block}.attn.c_proj.bias", (h,))
    out[f"layers.{i}.fc1.weight"] = _linear(f"{block}.mlp.c_fc.weight", (f, h), True)
    out[f"layers.{i}.fc1.bias"] = _linear(f"{block}.mlp.c_fc.bias", (f,))
    out[f"layers.{i}.fc2.weight"] = _linear(f"{block}.mlp.c_proj.weight", (h, f), True)
    out[f"layers.{i}.fc2.bias"] = _linear(f"{block}.mlp.c_proj.bias", (h,))
    return out


@memoized
def hf_sources(spec: ModelSpec) -> Mapping[str, HfSource]:
    """Every hethub parameter of ``spec`` by full-model name, with the HF tensors it is made of.
    Read-only."""
    h, v = spec.hidden, spec.vocab
    gpt = spec.arch == "gpt"
    layer = _gpt2_layer if gpt else _llama_layer
    out: dict[str, HfSource] = {}
    if gpt:
        out["embed.weight"] = _linear("transformer.wte.weight", (v, h))
        out["pos.weight"] = _linear("transformer.wpe.weight", (spec.position_rows, h))
    else:
        out["embed.weight"] = _linear("model.embed_tokens.weight", (v, h))
    for i in range(spec.layers):
        out.update(layer(spec, i))
    if gpt:
        out["final_norm.weight"] = _linear("transformer.ln_f.weight", (h,))
        out["final_norm.bias"] = _linear("transformer.ln_f.bias", (h,))
    else:
        out["final_norm.weight"] = _linear("model.norm.weight", (h,))
    if not spec.tied_head:
        out["head.weight"] = _linear("lm_head.weight", (v, h))
    table = parameter_table(spec)
    if set(out) != set(table):  # the two tables describe one model
        raise ValueError(f"HF names for {sorted(set(out) ^ set(table))} do not match the table")
    return MappingProxyType({name: out[name] for name in table})


def hf_tensors(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every HF tensor of ``spec``'s checkpoint by name, with its shape in the file, in the
    model's order: what an export writes and an import needs."""
    return {part.name: part.shape for source in hf_sources(spec).values() for part in source.parts}


def tied_head_name(spec: ModelSpec) -> str | None:
    """The output projection's HF name where the head is tied to the embedding (a checkpoint may
    hold it, a copy of the embedding; an import skips it), else None."""
    return "lm_head.weight" if spec.tied_head else None


def unprefixed(spec: ModelSpec, name: str) -> str:
    """``name`` without the base model's prefix: how a checkpoint of the base model alone names
    it (GPT-2's own: ``h.0.attn.c_attn.weight``)."""
    return name.removeprefix(BASE_PREFIX[spec.arch])


def is_ignored_buffer(name: str) -> bool:
    """A tensor of a HF checkpoint that is a buffer, not a weight (IGNORED_BUFFERS)."""
    return any(pattern.fullmatch(name) for pattern in IGNORED_BUFFERS)
