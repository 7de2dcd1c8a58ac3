"""The model: a GPT (Megatron-LM) or Llama transformer, from a preset name, a YAML file or a
HuggingFace model folder (spec.hf_config). Its dataclass, ModelSpec: spec.model_spec."""

from __future__ import annotations

import dataclasses
import math
from importlib import resources
from pathlib import Path
from typing import Any

from hethub.errors import SpecError
from hethub.spec.fields import Fields, field_names, load_yaml, parse_yaml, suggestion
from hethub.spec.hf_config import load_hf_config
from hethub.spec.model_spec import (
    ACTIVATIONS,
    ARCHS,
    HF_ARCHITECTURES,
    ModelSpec,
    RopeScaling,
    arch_defaults,
    with_seq_len,
)


def llama_ffn_hidden(hidden: int) -> int:
    """The Llama rule: 2/3 of 4*hidden, rounded up to a multiple of 256."""
    return 256 * math.ceil(8 * hidden / 3 / 256)


def preset_names() -> list[str]:
    folder = resources.files("hethub.data").joinpath("models")
    return sorted(
        p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml")
    )


MODEL_FILE_FIELDS = tuple(name for name in field_names(ModelSpec) if name != "name")
"""What a model file gives, in ModelSpec's order (its ``name`` is the file's, unless it says)."""


def model_file_fields(model: ModelSpec) -> dict[str, Any]:
    """What a model file holds for ``model`` (parse_model reads it back to an equal spec): every
    dimension, and each other field only where it is not its arch's default, so that a model of
    dimensions alone is written as it was before those fields existed."""
    defaults = arch_defaults(model.arch)
    fields = {f: getattr(model, f) for f in MODEL_FILE_FIELDS if f not in defaults}
    fields.update({f: getattr(model, f) for f in defaults if getattr(model, f) != defaults[f]})
    if model.rope_scaling is not None:
        fields["rope_scaling"] = {
            "type": RopeScaling.TYPE,
            **dataclasses.asdict(model.rope_scaling),
        }
    return fields


def _parse_rope_scaling(f: Fields) -> RopeScaling | None:
    if not f.has("rope_scaling"):
        return None
    rope = Fields(
        f.raw("rope_scaling"),
        f.source,
        f.path("rope_scaling"),
        allowed=("type", *field_names(RopeScaling)),
    )
    rope.choice("type", (RopeScaling.TYPE,))
    scaling = RopeScaling(**rope.declared(RopeScaling))
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise rope.error(
            "high_freq_factor",
            scaling.high_freq_factor,
            f"must be above low_freq_factor ({scaling.low_freq_factor})",
        )
    return scaling


def _check_arch_options(f: Fields, arch: str) -> None:
    """The fields beyond the dimensions that ``arch`` refuses or constrains."""
    if arch == "gpt":
        for llama_only in ("rope_theta", "rope_scaling"):
            if f.has(llama_only):
                raise f.error(
                    llama_only,
                    f.raw(llama_only),
                    "gpt has learned positions, not rotary: leave it out",
                )
    if f.has("hf_architecture"):
        hf_architecture = f.string("hf_architecture")
        if HF_ARCHITECTURES.get(hf_architecture) != arch:
            known = [name for name, of in HF_ARCHITECTURES.items() if of == arch]
            hint = suggestion(hf_architecture, known)
            raise f.error(
                "hf_architecture",
                hf_architecture,
                f"arch {arch} is one of {', '.join(known)}{hint}",
            )


def _parse_dimensions(f: Fields, read: dict[str, Any]) -> dict[str, Any]:
    """``kv_heads`` and ``ffn_hidden``, whose defaults are other fields' (``read``), with the
    rules between the dimensions."""
    arch, hidden, heads = read["arch"], read["hidden"], read["heads"]
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
    longest = read["max_position_embeddings"]
    if longest is not None and read["seq_len"] > longest:
        raise f.error(
            "seq_len", read["seq_len"], f"must be at most max_position_embeddings ({longest})"
        )
    default_ffn = 4 * hidden if arch == "gpt" else llama_ffn_hidden(hidden)
    return {"kv_heads": kv_heads, "ffn_hidden": f.positive_int("ffn_hidden", default_ffn)}


def parse_model(data: Any, source: str, name: str) -> ModelSpec:
    """Validate a parsed model file (``name``: the model's name unless the file gives one)."""
    f = Fields(data, source, allowed=field_names(ModelSpec))
    read = f.declared(
        ModelSpec, skip=("name", "kv_heads", "ffn_hidden", "rope_scaling", "activation")
    )
    arch = read["arch"]
    _check_arch_options(f, arch)
    return ModelSpec(
        **read,
        name=str(f.raw("name", name)),  # a label: any scalar, shown as text
        **_parse_dimensions(f, read),
        rope_scaling=_parse_rope_scaling(f),
        activation=f.choice("activation", ACTIVATIONS[arch], ACTIVATIONS[arch][0]),
    )


def load_model(
    ref: str | Path,
    relative_to: Path | None = None,
    source: str = "",
    field: str = "model",
    *,
    seq_len: int | None = None,
) -> ModelSpec:
    """A model by preset name, by the path of a model YAML, or by a HuggingFace model folder
    holding a config.json (or that file's path); paths relative to ``relative_to`` if given.
    ``seq_len`` replaces the model's sequence length (at most its max_position_embeddings); a
    HuggingFace config's default is spec.hf_config.DEFAULT_SEQ_LEN_CAP or its
    max_position_embeddings, the smaller."""
    text = str(ref)
    if text.lower() in preset_names():
        name = text.lower()
        text = resources.files("hethub.data").joinpath("models", f"{name}.yaml").read_text()
        model = parse_model(parse_yaml(text, f"preset {name}"), f"preset {name}", name)
        return model if seq_len is None else with_seq_len(model, seq_len, source)
    path = Path(text)
    if relative_to is not None and not path.is_absolute():
        path = relative_to / path
    if path.is_dir() or path.suffix == ".json":
        return load_hf_config(path, seq_len)
    if text.endswith((".yaml", ".yml")) or path.exists():
        model = parse_model(load_yaml(path, "model"), str(path), path.stem)
        return model if seq_len is None else with_seq_len(model, seq_len, source)
    raise SpecError(
        source,
        field,
        text,
        f"not a preset{suggestion(text, preset_names())} nor an existing model file or "
        f"HuggingFace model folder; presets: {', '.join(preset_names())}",
    )


__all__ = [
    "ACTIVATIONS",
    "ARCHS",
    "HF_ARCHITECTURES",
    "MODEL_FILE_FIELDS",
    "ModelSpec",
    "RopeScaling",
    "arch_defaults",
    "llama_ffn_hidden",
    "load_model",
    "model_file_fields",
    "parse_model",
    "preset_names",
    "with_seq_len",
]
