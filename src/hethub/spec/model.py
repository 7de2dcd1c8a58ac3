"""The model: a GPT (Megatron-LM) or Llama transformer, from a preset name or a YAML file."""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from hethub.errors import SpecError
from hethub.spec.fields import Fields, load_yaml, parse_yaml, suggestion
from hethub.spec.hashing import hashed_once

ARCHS = ("gpt", "llama")


@dataclass(frozen=True, kw_only=True, slots=True)
@hashed_once()
class ModelSpec:
    """Transformer dimensions.

    gpt: learned positions, LayerNorm, GELU MLP of ffn_hidden (4*hidden), biases, tied embedding.
    llama: rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention, untied output head.
    Its parameters (names, shapes, counts): hethub.spec.parameters.
    """

    name: str
    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    """Key/value heads; < heads means grouped-query attention (always = heads for gpt)."""
    ffn_hidden: int
    vocab: int
    seq_len: int

    @property
    def tied_head(self) -> bool:
        """The output head is the token embedding's weight (gpt), not a matrix of its own."""
        return self.arch == "gpt"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_hidden(self) -> int:
        """Width of the K (and of the V) projection."""
        return self.kv_heads * self.head_dim

    @property
    def mlp_matrices(self) -> int:
        """hidden x ffn weight matrices in the MLP: 2 (up, down) for GELU, 3 (gate, up, down) for
        SwiGLU."""
        return 3 if self.arch == "llama" else 2


def llama_ffn_hidden(hidden: int) -> int:
    """The Llama rule: 2/3 of 4*hidden, rounded up to a multiple of 256."""
    return 256 * math.ceil(8 * hidden / 3 / 256)


def preset_names() -> list[str]:
    folder = resources.files("hethub.data").joinpath("models")
    return sorted(
        p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml")
    )


MODEL_FILE_FIELDS = (
    "arch",
    "hidden",
    "layers",
    "heads",
    "kv_heads",
    "ffn_hidden",
    "vocab",
    "seq_len",
)


def model_file_fields(model: ModelSpec) -> dict[str, Any]:
    """What a model file holds for ``model`` (parse_model reads it back to an equal spec)."""
    return {f: getattr(model, f) for f in MODEL_FILE_FIELDS}


def parse_model(data: Any, source: str, name: str) -> ModelSpec:
    """Validate a parsed model file."""
    f = Fields(data, source, allowed=(*MODEL_FILE_FIELDS, "name"))
    arch = f.choice("arch", ARCHS)
    hidden, heads = f.positive_int("hidden"), f.positive_int("heads")
    if hidden % heads:
        raise f.error("heads", heads, f"must divide hidden ({hidden})")
    kv_heads = f.positive_int("kv_heads", heads)
    if arch == "gpt" and kv_heads != heads:
        raise f.error(
            "kv_heads",
            kv_heads,
            "gpt has no grouped-query attention: leave it out or set it to heads",
        )
    if heads % kv_heads:
        raise f.error("kv_heads", kv_heads, f"must divide heads ({heads})")
    default_ffn = 4 * hidden if arch == "gpt" else llama_ffn_hidden(hidden)
    return ModelSpec(
        name=str(f.raw("name", name)),
        arch=arch,
        hidden=hidden,
        layers=f.positive_int("layers"),
        heads=heads,
        kv_heads=kv_heads,
        ffn_hidden=f.positive_int("ffn_hidden", default_ffn),
        vocab=f.positive_int("vocab"),
        seq_len=f.positive_int("seq_len"),
    )


def load_model(
    ref: str | Path, relative_to: Path | None = None, source: str = "", field: str = "model"
) -> ModelSpec:
    """A model by preset name or by the path of a model YAML (relative to ``relative_to`` if
    given)."""
    text = str(ref)
    if text.lower() in preset_names():
        name = text.lower()
        text = resources.files("hethub.data").joinpath("models", f"{name}.yaml").read_text()
        return parse_model(parse_yaml(text, f"preset {name}"), f"preset {name}", name)
    path = Path(text)
    if relative_to is not None and not path.is_absolute():
        path = relative_to / path
    if text.endswith((".yaml", ".yml")) or path.exists():
        return parse_model(load_yaml(path, "model"), str(path), path.stem)
    raise SpecError(
        source,
        field,
        text,
        f"not a preset{suggestion(text, preset_names())} nor an existing model file; "
        f"presets: {', '.join(preset_names())}",
    )
