"""HuggingFace model configs (config.json) as hethub models, and back: the Llama family
(LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM) as arch llama, GPT2LMHeadModel as arch
gpt. Every field that would change the maths and that hethub does not run is refused in one line
naming it and its value (a sliding window, another rope type, a bias on the MLP, ...), never
ignored. Dropout probabilities are the one kind of field read past: hethub trains without
dropout, as Llama's and Qwen2's own configs do (GPT-2's 0.1 applies to its training only).

Pure Python: the predictor and the planner read models too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hethub.errors import HethubError, SpecError
from hethub.spec.model_spec import (
    DEFAULT_NORM_EPS,
    DEFAULT_ROPE_THETA,
    HF_ARCHITECTURES,
    ModelSpec,
    RopeScaling,
    with_seq_len,
)

DEFAULT_SEQ_LEN_CAP = 4096
"""A HuggingFace model's sequence length when none is given: its max_position_embeddings, at
most this (Llama 3.1's 131072 would price and train a context few runs want)."""
LLAMA_FAMILY_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
"""Each Llama-family class and the model_type transformers' AutoConfig knows it by."""


class _Config:
    """Reads of one config.json's fields, each error naming the file, the field and the rule."""

    def __init__(self, config: dict[str, Any], source: str) -> None:
        self.config, self.source = config, source

    def get(self, key: str, default: Any = None) -> Any:
        value = self.config.get(key)
        return default if value is None else value

    def refuse(self, key: str, value: Any, rule: str) -> SpecError:
        return SpecError(self.source, key, value, rule)

    def positive_int(self, key: str, default: Any = None) -> int:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self.refuse(key, value, "must be a positive integer")
        return value

    def positive_number(self, key: str, default: Any = None) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise self.refuse(key, value, "must be a positive number")
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise self.refuse(key, value, "must be true or false")
        return value

    def must_be(self, key: str, allowed: tuple[Any, ...], rule: str) -> None:
        """Refuse ``key`` unless it is absent (null) or one of ``allowed``."""
        value = self.config.get(key)
        if value is not None and value not in allowed:
            raise self.refuse(key, value, rule)


def model_from_hf_config(
    config: dict[str, Any], source: str, seq_len: int | None = None, *, name: str = ""
) -> ModelSpec:
    """The hethub model of a HuggingFace ``config`` (a parsed config.json) read from
    ``source``, trained on ``seq_len`` tokens a sequence (default: its max_position_embeddings,
    at most DEFAULT_SEQ_LEN_CAP). SpecError for an architecture or a field hethub does not run."""
    if not isinstance(config, dict):
        raise SpecError(source, "<top level>", type(config).__name__, "must be a JSON object")
    c = _Config(config, source)
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or len(architectures) != 1:
        raise c.refuse(
            "architectures",
            architectures,
            f"must name one of {', '.join(HF_ARCHITECTURES)} (a list of one)",
        )
    (architecture,) = architectures
    if architecture not in HF_ARCHITECTURES:
        raise c.refuse(
            "architectures",
            architecture,
            f"hethub runs {', '.join(HF_ARCHITECTURES)}, not this architecture",
        )
    read = _gpt2 if architecture == "GPT2LMHeadModel" else _llama_family
    fields = read(c, architecture)
    longest = fields["max_position_embeddings"]
    model = ModelSpec(
        name=name or architecture,
        seq_len=min(longest, DEFAULT_SEQ_LEN_CAP),
        hf_architecture=architecture,
        **fields,
    )
    if seq_len is not None:
        model = with_seq_len(model, seq_len, source)
    window = config.get("sliding_window") if architecture == "MistralForCausalLM" else None
    if window is not None and window < model.seq_len:
        raise c.refuse(
            "sliding_window",
            window,
            f"shorter than the sequence ({model.seq_len} tokens): hethub runs full attention only",
        )
    return model


def _heads(c: _Config, hidden: int, heads_key: str) -> tuple[int, int]:
    """Query heads (dividing hidden) and KV heads (dividing them)."""
    heads = c.positive_int(heads_key)
    if hidden % heads:
        raise c.refuse(heads_key, heads, f"must divide the hidden size ({hidden})")
    kv_heads = c.positive_int("num_key_value_heads", heads)
    if heads % kv_heads:
        raise c.refuse("num_key_value_heads", kv_heads, f"must divide {heads_key} ({heads})")
    head_dim = c.get("head_dim", hidden // heads)
    if head_dim != hidden // heads:
        raise c.refuse(
            "head_dim", head_dim, f"hethub runs head_dim = hidden_size / {heads_key} only"
        )
    return heads, kv_heads


def _llama_family(c: _Config, architecture: str) -> dict[str, Any]:
    """A Llama, Mistral or Qwen2 config's fields."""
    hidden = c.positive_int("hidden_size")
    heads, kv_heads = _heads(c, hidden, "num_attention_heads")
    c.must_be("hidden_act", ("silu",), "hethub runs the SiLU-gated MLP (silu) only")
    c.must_be("mlp_bias", (False,), "hethub's SwiGLU MLP has no biases")
    c.must_be("partial_rotary_factor", (1, 1.0), "hethub rotates every feature of a head (1.0)")
    longest = c.positive_int("max_position_embeddings")
    if architecture == "Qwen2ForCausalLM":
        qkv_bias, o_bias = True, False  # Qwen2's attention: biases on q, k and v only
        c.must_be("use_sliding_window", (False,), "hethub runs full attention only")
        layer_types = c.get("layer_types", [])
        if any(kind != "full_attention" for kind in layer_types):
            sliding = next(kind for kind in layer_types if kind != "full_attention")
            raise c.refuse("layer_types", sliding, "hethub runs full_attention layers only")
    else:
        qkv_bias = o_bias = c.boolean("attention_bias", False)
    return {
        "arch": "llama",
        "hidden": hidden,
        "layers": c.positive_int("num_hidden_layers"),
        "heads": heads,
        "kv_heads": kv_heads,
        "ffn_hidden": c.positive_int("intermediate_size"),
        "vocab": c.positive_int("vocab_size"),
        "norm_eps": c.positive_number("rms_norm_eps", DEFAULT_NORM_EPS),
        "tie_word_embeddings": c.boolean("tie_word_embeddings", False),
        "qkv_bias": qkv_bias,
        "o_bias": o_bias,
        "max_position_embeddings": longest,
        **_rope(c, longest),
    }


def _rope(c: _Config, longest: int) -> dict[str, Any]:
    """rope_theta and rope_scaling, from either of transformers' forms: rope_parameters (v5:
    rope_type, rope_theta and the scaling's fields in one object) or rope_theta beside
    rope_scaling (before)."""
    key = "rope_parameters" if c.get("rope_parameters") else "rope_scaling"
    rope = c.get(key, {})
    if not isinstance(rope, dict):
        raise c.refuse(key, rope, "must be an object")
    if any(isinstance(value, dict) for value in rope.values()):
        raise c.refuse(key, "per layer type", "hethub runs one rotary for every layer")
    kind = rope.get("rope_type") or rope.get("type") or "default"
    theta = rope.get("rope_theta", c.get("rope_theta", DEFAULT_ROPE_THETA))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise c.refuse("rope_theta", theta, "must be a positive number")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise c.refuse(
            f"{key}.partial_rotary_factor",
            rope["partial_rotary_factor"],
            "hethub rotates every feature of a head (1.0)",
        )
    if kind == "default":
        return {"rope_theta": float(theta), "rope_scaling": None}
    if kind != RopeScaling.TYPE:
        raise c.refuse(
            f"{key}.rope_type", kind, f"hethub runs rope types default and {RopeScaling.TYPE} only"
        )
    values = {}
    for field in ("factor", "low_freq_factor", "high_freq_factor"):
        value = rope.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise c.refuse(f"{key}.{field}", value, "must be a positive number")
        values[field] = float(value)
    if values["high_freq_factor"] <= values["low_freq_factor"]:
        raise c.refuse(
            f"{key}.high_freq_factor",
            values["high_freq_factor"],
            f"must be above low_freq_factor ({values['low_freq_factor']})",
        )
    original = rope.get("original_max_position_embeddings", longest)
    if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
        raise c.refuse(
            f"{key}.original_max_position_embeddings", original, "must be a positive integer"
        )
    scaling = RopeScaling(original_max_position_embeddings=original, **values)
    return {"rope_theta": float(theta), "rope_scaling": scaling}


GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
"""GPT-2's activation_function values hethub runs, and hethub's name of each."""


def _gpt2(c: _Config, architecture: str) -> dict[str, Any]:
    """A GPT-2 config's fields."""
    hidden = c.positive_int("n_embd")
    heads, _ = _heads(c, hidden, "n_head")
    activation = c.get("activation_function", "gelu_new")
    if activation not in GPT2_ACTIVATIONS:
        raise c.refuse(
            "activation_function",
            activation,
            f"hethub runs {', '.join(GPT2_ACTIVATIONS)} for GPT-2",
        )
    c.must_be("scale_attn_weights", (True,), "hethub scales the scores by 1/sqrt(head_dim)")
    c.must_be(
        "scale_attn_by_inverse_layer_idx", (False,), "hethub scales every layer's scores alike"
    )
    c.must_be("reorder_and_upcast_attn", (False,), "hethub's attention is one SDPA kernel")
    c.must_be("add_cross_attention", (False,), "hethub runs decoder-only models")
    return {
        "arch": "gpt",
        "hidden": hidden,
        "layers": c.positive_int("n_layer"),
        "heads": heads,
        "kv_heads": heads,
        "ffn_hidden": c.positive_int("n_inner", 4 * hidden),
        "vocab": c.positive_int("vocab_size"),
        "norm_eps": c.positive_number("layer_norm_epsilon", DEFAULT_NORM_EPS),
        "tie_word_embeddings": c.boolean("tie_word_embeddings", True),
        "qkv_bias": True,
        "o_bias": True,
        "activation": GPT2_ACTIVATIONS[activation],
        "max_position_embeddings": c.positive_int("n_positions"),
    }


def hf_config_from_model(model: ModelSpec) -> dict[str, Any]:
    """The config.json of ``model`` that transformers loads back as the same model: the fields
    that decide its maths (dtype and special tokens are the exporter's to add). The class is
    model.hf_architecture, else the one that runs it: LlamaForCausalLM for a llama (Qwen2's
    for q/k/v biases without the output's), GPT2LMHeadModel for a gpt. SpecError where that
    class cannot hold the model."""
    architecture = model.hf_architecture or _default_architecture(model)
    if architecture == "GPT2LMHeadModel":
        return _gpt2_config(model)
    return _llama_family_config(model, architecture)


def _default_architecture(model: ModelSpec) -> str:
    if model.arch == "gpt":
        return "GPT2LMHeadModel"
    qwen2 = model.qkv_bias and not model.o_bias
    return "Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"


def _cannot_export(model: ModelSpec, field: str, value: Any, architecture: str) -> SpecError:
    return SpecError(model.name, field, value, f"{architecture} cannot hold it: not exported")


def _llama_family_config(model: ModelSpec, architecture: str) -> dict[str, Any]:
    if architecture == "Qwen2ForCausalLM":
        if not (model.qkv_bias and not model.o_bias):
            bias = (model.qkv_bias, model.o_bias)
            raise _cannot_export(model, "qkv_bias, o_bias", bias, architecture)
        bias_fields = {"use_sliding_window": False, "sliding_window": None}
    else:
        if model.qkv_bias != model.o_bias:
            bias = (model.qkv_bias, model.o_bias)
            raise _cannot_export(model, "qkv_bias, o_bias", bias, architecture)
        bias_fields = {"attention_bias": model.qkv_bias, "mlp_bias": False}
        if architecture == "MistralForCausalLM":
            bias_fields = {"sliding_window": None}  # hethub trained it with full attention
    scaling = None
    if model.rope_scaling is not None:
        scaling = {"rope_type": RopeScaling.TYPE, **_rope_scaling_fields(model.rope_scaling)}
    return {
        "architectures": [architecture],
        "model_type": LLAMA_FAMILY_TYPES[architecture],
        "hidden_size": model.hidden,
        "intermediate_size": model.ffn_hidden,
        "num_hidden_layers": model.layers,
        "num_attention_heads": model.heads,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.head_dim,
        "hidden_act": "silu",
        "vocab_size": model.vocab,
        "max_position_embeddings": model.position_rows,
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": model.tie_word_embeddings,
        "attention_dropout": 0.0,
        **bias_fields,
    }


def _rope_scaling_fields(scaling: RopeScaling) -> dict[str, Any]:
    return {
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
    }


def _gpt2_config(model: ModelSpec) -> dict[str, Any]:
    architecture = "GPT2LMHeadModel"
    if not (model.qkv_bias and model.o_bias):
        raise _cannot_export(
            model, "qkv_bias, o_bias", (model.qkv_bias, model.o_bias), architecture
        )
    activation = {"gelu_tanh": "gelu_new", "gelu": "gelu"}[model.activation]
    return {
        "architectures": [architecture],
        "model_type": "gpt2",
        "n_embd": model.hidden,
        "n_layer": model.layers,
        "n_head": model.heads,
        "n_inner": model.ffn_hidden,
        "n_positions": model.position_rows,
        "vocab_size": model.vocab,
        "activation_function": activation,
        "layer_norm_epsilon": model.norm_eps,
        "tie_word_embeddings": model.tie_word_embeddings,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        # hethub trains without dropout: the exported model is the one it trained
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    }


def load_hf_config(path: Path, seq_len: int | None = None) -> ModelSpec:
    """The model of a HuggingFace model folder (its config.json) or of a config.json's path."""
    folder = path.is_dir()
    file = path / "config.json" if folder else path
    if folder and not file.is_file():
        raise HethubError(
            f"{path}: is a directory without a config.json; give a model YAML file or a "
            f"HuggingFace model folder"
        )
    if not file.is_file():
        raise HethubError(f"{file}: model config not found (give an existing config.json)")
    try:
        config = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise HethubError(f"{file}: not a valid JSON config ({error})") from None
    name = path.name if folder else path.parent.name if file.name == "config.json" else path.stem
    return model_from_hf_config(config, str(file), seq_len, name=name)
