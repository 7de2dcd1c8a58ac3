"""The model's specification: the ModelSpec dataclass, its archs and their defaults. Below
spec.model (model files, presets, loading) and spec.hf_config (HuggingFace configs), which both
make one; most code imports it from spec.model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hethub.errors import SpecError
from hethub.spec.fields import rules
from hethub.spec.hashing import hashed_once

ARCHS = ("gpt", "llama")
ACTIVATIONS = {"gpt": ("gelu", "gelu_tanh"), "llama": ("swiglu",)}
"""The MLP activations each arch runs, its default first: gpt's exact GELU (Megatron-LM's) or
its tanh approximation (GPT-2's gelu_new); llama's SiLU-gated SwiGLU."""
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "GPT2LMHeadModel": "gpt",
}
"""The HuggingFace model classes hethub reads and writes (spec.hf_config), with the arch each is."""
DEFAULT_ROPE_THETA = 10000.0
DEFAULT_NORM_EPS = 1e-5


@dataclass(frozen=True, kw_only=True, slots=True)
class RopeScaling:
    """Llama 3.1's rotary frequency scaling (HuggingFace's rope type "llama3"): wavelengths
    longer than original_max_position_embeddings / low_freq_factor are stretched by ``factor``,
    those shorter than original_max_position_embeddings / high_freq_factor kept, the ones
    between interpolated smoothly. The only scaling hethub runs; other types are refused."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    TYPE = "llama3"


def _resolving_arch_defaults(cls: type) -> type:
    """Placed above hashed_once: fills each field left None with its arch's default
    (ModelSpec._fill_arch_defaults) before the hash is taken, so that a spec made with the
    defaults and one naming them are equal and hash alike."""
    hash_once = cls.__post_init__

    def __post_init__(self) -> None:
        self._fill_arch_defaults()
        hash_once(self)

    cls.__post_init__ = __post_init__
    return cls


@dataclass(frozen=True, kw_only=True, slots=True)
@_resolving_arch_defaults
@hashed_once()
class ModelSpec:
    """Transformer dimensions and the choices that change its maths.

    gpt: learned positions, LayerNorm, GELU MLP of ffn_hidden (4*hidden), biases, tied embedding.
    llama: rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention, untied output head.
    Qwen2 is a llama with q/k/v biases; GPT-2 a gpt with the tanh GELU. Fields left None take
    their arch's default when the spec is made, so after that every field holds its value.
    Its parameters (names, shapes, counts): hethub.spec.parameters.
    """

    name: str
    arch: str = field(metadata=rules(choices=ARCHS))
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    """Key/value heads; < heads means grouped-query attention (always = heads for gpt)."""
    ffn_hidden: int
    vocab: int
    seq_len: int
    rope_theta: float = DEFAULT_ROPE_THETA
    """The rotary base (llama): Llama 2's 10000, Llama 3's 500000."""
    rope_scaling: RopeScaling | None = None
    """Llama 3.1's frequency scaling, or None for plain rotary."""
    norm_eps: float = DEFAULT_NORM_EPS
    """The epsilon of every norm (RMSNorm's or LayerNorm's)."""
    tie_word_embeddings: bool | None = None
    """The output head is the token embedding's weight (default: gpt yes, llama no)."""
    qkv_bias: bool | None = None
    """The QKV projection adds a bias (default: gpt yes, llama no; Qwen2 yes)."""
    o_bias: bool | None = None
    """The attention's output projection adds a bias (default: gpt yes, llama no)."""
    activation: str | None = None
    """The MLP's activation, one of ACTIVATIONS[arch] (default: the first)."""
    max_position_embeddings: int | None = None
    """The longest sequence the model takes (seq_len is at most this); None: seq_len. GPT's
    learned positions have this many rows."""
    hf_architecture: str | None = None
    """The HuggingFace class the model came from and is exported as (HF_ARCHITECTURES)."""

    def _fill_arch_defaults(self) -> None:
        for name, default in arch_defaults(self.arch).items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)

    @property
    def tied_head(self) -> bool:
        """The output head is the token embedding's weight, not a matrix of its own."""
        return self.tie_word_embeddings

    @property
    def position_rows(self) -> int:
        """Rows of GPT's learned position embedding: every position the model takes."""
        return self.max_position_embeddings or self.seq_len

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


def arch_defaults(arch: str) -> dict[str, Any]:
    """Every field beyond the dimensions at its default for ``arch``: a spec's, and what a model
    file leaves out."""
    gpt = arch == "gpt"
    return {
        "rope_theta": DEFAULT_ROPE_THETA,
        "rope_scaling": None,
        "norm_eps": DEFAULT_NORM_EPS,
        "tie_word_embeddings": gpt,
        "qkv_bias": gpt,
        "o_bias": gpt,
        "activation": ACTIVATIONS.get(arch, ("",))[0],
        "max_position_embeddings": None,
        "hf_architecture": None,
    }


def with_seq_len(
    model: ModelSpec, seq_len: int, source: str = "", field: str = "seq_len"
) -> ModelSpec:
    """``model`` trained on sequences of ``seq_len`` tokens, which must be at most its
    max_position_embeddings."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
        raise SpecError(source, field, seq_len, "must be a positive integer")
    longest = model.max_position_embeddings
    if longest is not None and seq_len > longest:
        rule = f"must be at most the model's max_position_embeddings ({longest})"
        raise SpecError(source, field, seq_len, rule)
    return dataclasses.replace(model, seq_len=seq_len)
