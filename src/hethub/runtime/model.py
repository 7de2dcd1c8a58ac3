"""Llama and GPT stages, built per rank for its layers and TP shard only, from one seeded
initialisation of the full model, so that every layout starts from exactly the same weights.

Full-model parameter names (the checkpoint's, whatever the layout):
  embed.weight [vocab, h]; pos.weight [seq, h] (gpt)
  layers.{i}.norm1 / norm2 (.weight, .bias for gpt)
  layers.{i}.q / k / v (.weight [heads*d | kv*d, h], .bias for gpt); layers.{i}.o (.weight [h, h], .bias)
  layers.{i}.gate / up (.weight [f, h], llama), layers.{i}.down (.weight [h, f], llama)
  layers.{i}.fc1 (.weight [f, h], .bias), layers.{i}.fc2 (.weight [h, f], .bias) (gpt)
  final_norm (.weight, .bias for gpt); head.weight [vocab, h] (llama; gpt ties it to embed.weight)
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hethub.runtime.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to,
    tp_rank,
    tp_size,
    vocab_parallel_cross_entropy,
)
from hethub.spec.model import ModelSpec

INIT_STD = 0.02
COLUMN = ("q", "k", "v", "gate", "up", "fc1")  # sharded over output features
ROW = ("o", "down", "fc2")  # sharded over input features


def full_state(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """The whole model's initial weights (fp32), the same for every layout given the seed."""
    gen = torch.Generator().manual_seed(seed)
    h, d, f = spec.hidden, spec.head_dim, spec.ffn_hidden
    gpt = spec.arch == "gpt"

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * INIT_STD

    state = {"embed.weight": normal(spec.vocab, h)}
    if gpt:
        state["pos.weight"] = normal(spec.seq_len, h)
    shapes = {
        "q": (spec.heads * d, h),
        "k": (spec.kv_heads * d, h),
        "v": (spec.kv_heads * d, h),
        "o": (h, h),
    }
    shapes.update(
        {"fc1": (f, h), "fc2": (h, f)} if gpt else {"gate": (f, h), "up": (f, h), "down": (h, f)}
    )
    for i in range(spec.layers):
        for norm in ("norm1", "norm2"):
            state[f"layers.{i}.{norm}.weight"] = torch.ones(h)
            if gpt:
                state[f"layers.{i}.{norm}.bias"] = torch.zeros(h)
        for name, shape in shapes.items():
            # Output projections scaled down with depth (GPT-2), so deep models start stable.
            scale = 1 / math.sqrt(2 * spec.layers) if name in ROW else 1.0
            state[f"layers.{i}.{name}.weight"] = normal(*shape) * scale
            if gpt:
                state[f"layers.{i}.{name}.bias"] = torch.zeros(shape[0])
    state["final_norm.weight"] = torch.ones(h)
    if gpt:
        state["final_norm.bias"] = torch.zeros(h)
    else:
        state["head.weight"] = normal(spec.vocab, h)
    return state


def shard(name: str, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This TP rank's slice of a full-model tensor."""
    kind = name.split(".")[-2] if name.startswith("layers.") else name.split(".")[0]
    if kind in ("embed", "head") or kind in COLUMN:
        return tensor.chunk(size, dim=0)[rank].clone()
    if kind in ROW and name.endswith("weight"):
        return tensor.chunk(size, dim=1)[rank].clone()
    return tensor.clone()  # norms, positions, row-parallel biases: whole on every rank


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on (B, heads, T, d)."""
    t, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = torch.outer(torch.arange(t, dtype=torch.float32), inv)  # (T, d/2)
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * cos + half * sin


class Layer(nn.Module):
    """One transformer layer, Megatron-style: attention heads and the MLP split over TP."""

    def __init__(self, spec: ModelSpec, group) -> None:
        super().__init__()
        self.spec, self.group = spec, group
        size, gpt, h, d = tp_size(group), spec.arch == "gpt", spec.hidden, spec.head_dim
        norm = (lambda: nn.LayerNorm(h)) if gpt else (lambda: RMSNorm(h))
        self.norm1, self.norm2 = norm(), norm()
        self.heads, self.kv_heads = spec.heads // size, spec.kv_heads // size
        self.q = ColumnParallelLinear(h, spec.heads * d, gpt, group)
        self.k = ColumnParallelLinear(h, spec.kv_heads * d, gpt, group)
        self.v = ColumnParallelLinear(h, spec.kv_heads * d, gpt, group)
        self.o = RowParallelLinear(h, h, gpt, group)
        if gpt:
            self.fc1 = ColumnParallelLinear(h, spec.ffn_hidden, True, group)
            self.fc2 = RowParallelLinear(spec.ffn_hidden, h, True, group)
        else:
            self.gate = ColumnParallelLinear(h, spec.ffn_hidden, False, group)
            self.up = ColumnParallelLinear(h, spec.ffn_hidden, False, group)
            self.down = RowParallelLinear(spec.ffn_hidden, h, False, group)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        d = self.spec.head_dim
        q = self.q(x).view(b, t, self.heads, d).transpose(1, 2)  # (B, heads, T, d)
        k = self.k(x).view(b, t, self.kv_heads, d).transpose(1, 2)  # (B, kv, T, d)
        v = self.v(x).view(b, t, self.kv_heads, d).transpose(1, 2)
        if self.spec.arch == "llama":
            q, k = rotary(q), rotary(k)
        if (
            self.kv_heads != self.heads
        ):  # grouped-query attention: each KV head serves several queries
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, t, self.heads * d))  # (B, T, h)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.arch == "gpt":
            return self.fc2(nn.functional.gelu(self.fc1(x)))
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Stage(nn.Module):
    """Layers [first, first + count) of the model on one TP rank; the first stage also embeds the
    tokens, the last also normalises, projects to the (vocabulary-parallel) logits and scores them."""

    def __init__(
        self, spec: ModelSpec, first: int, count: int, group, *, is_first: bool, is_last: bool
    ) -> None:
        super().__init__()
        self.spec, self.first, self.group = spec, first, group
        self.is_first, self.is_last = is_first, is_last
        gpt = spec.arch == "gpt"
        if is_first:
            self.embed = VocabParallelEmbedding(spec.vocab, spec.hidden, group)
            if gpt:
                self.pos = nn.Embedding(spec.seq_len, spec.hidden)
        self.layers = nn.ModuleDict({str(first + i): Layer(spec, group) for i in range(count)})
        if is_last:
            self.final_norm = nn.LayerNorm(spec.hidden) if gpt else RMSNorm(spec.hidden)
            # gpt ties the head to the embedding: on a stage without the embedding it keeps a copy,
            # whose gradient the runtime adds to the embedding's.
            if not (gpt and is_first):
                self.head = nn.Parameter(torch.empty(spec.vocab // tp_size(group), spec.hidden))

    @property
    def head_weight(self) -> torch.Tensor:
        return self.head if hasattr(self, "head") else self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens (B, T) on the first stage, hidden states (B, T, h) elsewhere; returns hidden
        states, or this rank's logit shard (B, T, vocab/tp) on the last stage."""
        if self.is_first:
            tokens = x
            x = self.embed(tokens)
            if self.spec.arch == "gpt":
                x = x + self.pos(torch.arange(tokens.shape[1]))
        for layer in self.layers.values():
            x = layer(x)
        if self.is_last:
            x = nn.functional.linear(copy_to(self.final_norm(x), self.group), self.head_weight)
        return x

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean token cross-entropy from this rank's logit shard."""
        start = tp_rank(self.group) * (self.spec.vocab // tp_size(self.group))
        return vocab_parallel_cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), start, self.group
        )

    def load_full(self, state: dict[str, torch.Tensor]) -> None:
        """Copy this stage's TP shard of the full-model weights in."""
        rank, size = tp_rank(self.group), tp_size(self.group)
        with torch.no_grad():
            for name, param in self.named_parameters():
                param.copy_(shard(self.full_name(name), state[self.full_name(name)], rank, size))

    def full_name(self, name: str) -> str:
        """This stage's parameter name as the full model names it."""
        if name == "head":
            return "head.weight" if self.spec.arch == "llama" else "embed.weight"
        return name


def stage_names(
    spec: ModelSpec, first: int, count: int, *, is_first: bool, is_last: bool
) -> list[str]:
    """The full-model parameter names a stage holds (a shard of each, under TP)."""
    gpt = spec.arch == "gpt"
    names = ["embed.weight"] + (["pos.weight"] if gpt else []) if is_first else []
    per_layer = ["norm1.weight", "norm2.weight", "q.weight", "k.weight", "v.weight", "o.weight"]
    per_layer += (
        ["fc1.weight", "fc2.weight"] if gpt else ["gate.weight", "up.weight", "down.weight"]
    )
    if gpt:
        per_layer += [
            "norm1.bias",
            "norm2.bias",
            "q.bias",
            "k.bias",
            "v.bias",
            "o.bias",
            "fc1.bias",
            "fc2.bias",
        ]
    names += [f"layers.{i}.{n}" for i in range(first, first + count) for n in per_layer]
    if is_last:
        names += ["final_norm.weight"] + (["final_norm.bias"] if gpt else [])
        if not (gpt and is_first):
            names.append("embed.weight" if gpt else "head.weight")
    return names
