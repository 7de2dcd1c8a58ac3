"""Llama and GPT stages, built per rank for its layers and TP shard only, from one seeded
initialisation of the full model, so that every layout starts from exactly the same weights.
The parameters' names, shapes and TP splits are hethub.spec.parameters' table.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from hethub.runtime.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_region,
    copy_to,
    gather_from_sequence,
    parallel_group,
    sum_gradient,
    tp_rank,
    tp_size,
    vocab_parallel_cross_entropy,
)
from hethub.spec.model_spec import DEFAULT_ROPE_THETA, ModelSpec, RopeScaling
from hethub.spec.parameters import (
    INIT_STD,
    FusedParts,
    Init,
    Parameter,
    gate_up_blocks,
    parameter_table,
    qkv_blocks,
)
from hethub.spec.plan import Recompute


def initial_value(param: Parameter, seed: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The whole of ``param``'s initial value (fp32, on the CPU), the same for every layout given
    the seed: written into ``out`` (a CPU tensor of the full shape) where given, else a new
    tensor. Each parameter draws from a generator of its own, seeded by its name: a rank makes
    the parameters it holds, one at a time, never the whole model. Drawn on the CPU so that ranks
    on different devices (whose generators differ) start from the same weights."""
    out = torch.empty(param.shape) if out is None else out
    if param.init is Init.ONES:
        return out.fill_(1.0)
    if param.init is Init.ZEROS:
        return out.zero_()
    seed_of_name = (seed * 1_000_003 + zlib.crc32(param.name.encode())) % 2**63
    gen = torch.Generator().manual_seed(seed_of_name)
    # in place: no second full-size tensor while a large parameter is made
    return out.normal_(generator=gen).mul_(INIT_STD).mul_(param.scale)


def full_state(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """The whole model's initial weights (fp32): a single-process reference's, or a test's."""
    return {name: initial_value(param, seed) for name, param in parameter_table(spec).items()}


NORM_EPS = 1e-5
"""The norms' epsilon where a spec gives none (ModelSpec.norm_eps's default)."""


class _CpuRmsNorm(torch.autograd.Function):
    """RMSNorm over the last dimension as torch computes it (upcast to fp32: a bf16 mean of
    squares loses the small ones; normalise, apply the weight in fp32, round once to the input's
    dtype), keeping for backward what an accelerator's fused kernel keeps: the input in its own
    dtype and the fp32 rstd, one float a row. torch 2.13's CPU RMSNorm is a composite of
    separate operations whose autograd keeps an fp32 copy of the input and the normalised input
    besides (6 bytes an element more in bf16); this backward rebuilds the normalised input
    from the input and rstd instead, in fp32, as the fused backward does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()  # (..., h); x itself in fp32
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(eps))  # (..., 1)
        ctx.save_for_backward(x, weight, rstd)
        return (x32 * rstd).mul_(weight).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        normalised = x.float() * rstd  # n, (..., h) fp32
        # dy * n in fp32 (a bf16 dy is read as fp32, not copied): the weight's gradient per token
        product = grad_out * normalised
        grad_weight = product.sum(tuple(range(grad_out.dim() - 1))).to(weight.dtype)
        along = product.mul_(weight).mean(-1, keepdim=True)  # mean(g n), g = dy * w; (..., 1)
        del product  # two (..., h) fp32 tensors alive at most
        # d/dx of x * rstd(x): rstd (g - n mean(g n)), made in n's place
        grad_x = normalised.mul_(along.neg_()).addcmul_(grad_out, weight).mul_(rstd)
        return grad_x.to(x.dtype), grad_weight, None


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (its weight, its eps) that keeps no more for backward on the CPU than on an
    accelerator. Elsewhere it is torch's own, F.rms_norm, which calls aten._fused_rms_norm: one
    kernel each way, keeping the input and the fp32 rstd. On the CPU it is _CpuRmsNorm: the same
    numbers as torch's CPU composite, forward; its gradients within fp32 rounding of it. Its
    weight must be in the input's dtype, as the stage's are."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return super().forward(x)
        return _CpuRmsNorm.apply(x, self.weight, self.eps)


class _SwiGlu(torch.autograd.Function):
    """SiLU(gate) * up of the gate|up GEMM's output (..., 2f), gate its first half: keeping for
    backward only that output, as Megatron-LM's fused SwiGLU does. Autograd's SiLU and multiply
    would keep SiLU's output besides (f elements a token); the backward recomputes it instead,
    one elementwise operation. The gradient is one (..., 2f) tensor, what the GEMM's backward
    reads, each half written in place: no concatenation, and no more than it alive at once
    besides the output's gradient."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)  # (..., f) views
        ctx.save_for_backward(gate_up)
        return F.silu(gate).mul_(up)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> torch.Tensor:
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        if torch.compiler.is_compiling():
            # dynamo refuses out= into the halves (strided views); inductor fuses this anyway
            grad_up = F.silu(gate).mul_(grad_out)
            return torch.cat([torch.ops.aten.silu_backward(grad_out * up, gate), grad_up], -1)
        grad = torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)
        grad_gate, grad_up = grad.chunk(2, dim=-1)
        torch.mul(grad_out, up, out=grad_gate)
        torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        torch.ops.aten.silu.out(gate, out=grad_up)
        grad_up.mul_(grad_out)
        return grad  # (..., 2f)


def shard(param: Parameter, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """TP rank ``rank``'s slice (a copy) of ``tensor``, a full-model tensor of ``param``'s shape."""
    if param.tp_dim is None:
        return tensor.clone()
    return tensor.chunk(size, dim=param.tp_dim)[rank].clone()


def fuse(parts: FusedParts, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The fused full-model tensor from its parts' full-model ``tensors`` (q, k and v; gate and
    up), in spec.parameters.fused_parts' order: a new tensor."""
    blocks = []
    for tensor, name, shape, size in zip(
        tensors, parts.names, parts.shapes, parts.sizes, strict=True
    ):
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} of shape {list(tensor.shape)}, not {list(shape)}")
        blocks.append(tensor.view(*parts.shape[: parts.dim], size, *parts.shape[parts.dim + 1 :]))
    return torch.cat(blocks, dim=parts.dim)


def unfuse(parts: FusedParts, fused: torch.Tensor) -> list[torch.Tensor]:
    """The parts' full-model tensors (each in its own shape; new tensors) of the fused
    full-model tensor ``fused``: fuse's inverse."""
    pieces = fused.split(list(parts.sizes), dim=parts.dim)
    return [piece.reshape(shape).clone() for piece, shape in zip(pieces, parts.shapes, strict=True)]


def rotary_inverse_frequencies(
    head_dim: int, theta: float = DEFAULT_ROPE_THETA, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """The rotary angle per position of each feature pair (d/2, fp32 on the CPU): theta^(-2i/d),
    and under Llama 3.1's scaling, its low frequencies divided by the factor and the middle ones
    interpolated, as transformers computes them (modeling_rope_utils'
    _compute_llama3_parameters, operation for operation, so that the tables are the same bits)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inverse = 1.0 / (theta**exponents)
    if scaling is None:
        return inverse
    old_context = scaling.original_max_position_embeddings
    low_wavelength = old_context / scaling.low_freq_factor
    high_wavelength = old_context / scaling.high_freq_factor
    wavelength = 2 * math.pi / inverse
    scaled = torch.where(wavelength > low_wavelength, inverse / scaling.factor, inverse)
    smooth = (old_context / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelength < high_wavelength) * ~(wavelength > low_wavelength)
    return torch.where(medium, smoothed, scaled)


class Rotary(nn.Module):
    """Rotary position embedding (the half-split pairing: feature i turns with i + d/2, as
    HuggingFace's Llama checkpoints lay q and k out) with its tables for positions
    [0, seq_len), made once, as non-persistent buffers: a stage's layers share one (checkpoints
    never see them). Its frequencies: rotary_inverse_frequencies of ``theta`` and ``scaling``.

    The tables are in the activations' dtype. The angles are computed in fp32 (bf16 cannot even
    count positions past 256) and each cosine and sine rounded once to that dtype: the rotated q
    and k are rounded to it anyway, so bf16 tables add an error of the size of that rounding,
    and they keep the rotation in bf16 in three operations (fp32 tables would promote q and k to
    fp32, whose attention then fails, or need two casts a call). A stage learns its compute dtype
    after it is built (runtime.precision makes its weights bf16), so the tables follow the
    activations: remade from the fp32 angles at the first call in a new dtype, once a run.
    """

    def __init__(
        self,
        head_dim: int,
        seq_len: int,
        theta: float = DEFAULT_ROPE_THETA,
        scaling: RopeScaling | None = None,
    ) -> None:
        super().__init__()
        self.head_dim, self.seq_len = head_dim, seq_len
        self.theta, self.scaling = theta, scaling
        self.register_buffer("cos", torch.empty(seq_len, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(seq_len, head_dim), persistent=False)
        self.reset_tables()

    def reset_tables(self, dtype: torch.dtype | None = None) -> None:
        """Compute the tables on their device, in ``dtype`` (their own if None). A stage made on
        the meta device and then allocated (Stage.build) holds garbage until this runs."""
        device, dtype = self.cos.device, dtype or self.cos.dtype
        inv = rotary_inverse_frequencies(self.head_dim, self.theta, self.scaling).to(device)
        positions = torch.arange(self.seq_len, dtype=torch.float32, device=device)
        angles = torch.outer(positions, inv)  # (T, d/2)
        cos, sin = angles.cos(), angles.sin()
        self.cos = torch.cat([cos, cos], dim=-1).to(dtype)  # (T, d)
        # Signed so that the rotation's other half is a roll of x: [-x2, x1] * [s, s] is
        # [x2, x1] * [-s, s].
        self.sin = torch.cat([-sin, sin], dim=-1).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x rotated by its positions: (..., T, d) in (the layer's queries come in as (B, kv,
        queries, T, d)), the same out, laid out in memory as x is."""
        if self.cos.dtype != x.dtype:
            self.reset_tables(x.dtype)
        t = x.shape[-2]
        cos, sin = self.cos[:t], self.sin[:t]
        return torch.addcmul(x * cos, x.roll(self.head_dim // 2, dims=-1), sin)


class ColumnParallelBlocks(nn.Module):
    """A column-parallel linear whose output features are ``blocks`` (spec.parameters' qkv and
    gate_up), split over TP along block dimension ``tp_dim``: one GEMM, y_shard = x W_shard^T
    (+ b_shard), (..., in) -> (..., this rank's blocks, flattened). Its weight is its blocks
    then the input features, as the parameter table lays them out, and its shard a contiguous
    slice of them."""

    def __init__(
        self,
        in_features: int,
        blocks: tuple[int, ...],
        tp_dim: int,
        bias: bool,
        group,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.group = parallel_group(group)
        self.sequence_parallel = sequence_parallel and self.group is not None
        local = list(blocks)
        local[tp_dim] //= tp_size(group)
        self.weight = nn.Parameter(torch.empty(*local, in_features))
        self.bias = nn.Parameter(torch.empty(local)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # flattened views: one GEMM over every block, no copy of the weight
        bias = self.bias.flatten() if self.bias is not None else None
        x = column_region(x, self.group, self.sequence_parallel)
        return F.linear(x, self.weight.flatten(0, -2), bias)


def replicated_on_shard(module: nn.Module, x: torch.Tensor, group) -> torch.Tensor:
    """``module`` (a norm, GPT's position embedding: weights every TP rank holds whole) applied
    to this rank's sequence shard ``x``: each rank's weight gradients come from its own tokens
    only, so they are summed over ``group`` (Megatron-LM all-reduces them once a step; here in
    the backward of each micro-batch, where the module's weights are used: sum_gradient)."""
    summed = {name: sum_gradient(p, group) for name, p in module.named_parameters()}
    return functional_call(module, summed, (x,))


def norm_of(spec: ModelSpec) -> nn.Module:
    """A norm over the hidden features with the spec's epsilon: GPT's LayerNorm, Llama's
    RMSNorm."""
    if spec.arch == "gpt":
        return nn.LayerNorm(spec.hidden, eps=spec.norm_eps)
    return RMSNorm(spec.hidden, eps=spec.norm_eps)


def rotary_of(spec: ModelSpec) -> Rotary:
    """The spec's rotary embedding for its sequence length."""
    return Rotary(spec.head_dim, spec.seq_len, spec.rope_theta, spec.rope_scaling)


class Layer(nn.Module):
    """One transformer layer, Megatron-style: attention heads and the MLP split over TP, one GEMM
    for q, k and v and one for gate and up. A Llama layer rotates with ``rotary``, its stage's
    (shared by the stage's layers), or one of its own.

    ``sequence_parallel`` (at TP > 1): the layer's input and output are this rank's sequence
    shard (B, T/t, h), its norms and residual adds run on it, and each block's input is gathered
    (all-gather) and its output reduce-scattered, in place of the all-reduces.
    """

    def __init__(
        self, spec: ModelSpec, group, rotary: Rotary | None = None, sequence_parallel=False
    ) -> None:
        super().__init__()
        self.spec = spec
        self.group = parallel_group(group)
        sp = self.sequence_parallel = sequence_parallel and self.group is not None
        size, gpt, h = tp_size(group), spec.arch == "gpt", spec.hidden
        self.norm1, self.norm2 = norm_of(spec), norm_of(spec)
        if not gpt:
            self.rotary = rotary if rotary is not None else rotary_of(spec)
        self.heads, self.kv_heads = spec.heads // size, spec.kv_heads // size
        # TP splits q, k and v by KV head, each with its query heads; gate and up by ffn feature
        self.qkv = ColumnParallelBlocks(h, qkv_blocks(spec), 0, spec.qkv_bias, group, sp)
        self.o = RowParallelLinear(h, h, spec.o_bias, group, sp)
        if gpt:
            self.fc1 = ColumnParallelLinear(h, spec.ffn_hidden, True, group, sp)
            self.fc2 = RowParallelLinear(spec.ffn_hidden, h, True, group, sp)
        else:
            self.gate_up = ColumnParallelBlocks(h, gate_up_blocks(spec), 1, False, group, sp)
            self.down = RowParallelLinear(spec.ffn_hidden, h, False, group, sp)

    checkpoint_attention: bool = False
    """Selective recomputation (Recompute.SELECTIVE; its Stage sets it at each forward, to the
    stage's): the attention's inner part is checkpointed, kept as its input only and run again
    in the backward."""

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, T, (heads + 2 kv) d / tp)
        if self.checkpoint_attention:
            # Keeps the QKV output, not q, k, v and the log-sum-exp; the rotations, the copy and
            # the kernel run again in the backward. torch's early stop, on, stops nothing: the
            # kernel, the last op to run, saves its outputs (dynamo, under a plan's compile,
            # refuses set_checkpoint_early_stop in the layer).
            out = checkpoint(self.inner_attention, qkv, use_reentrant=False)
        else:
            out = self.inner_attention(qkv)
        return self.o(out)  # (B, T, h)

    def inner_attention(self, qkv: torch.Tensor) -> torch.Tensor:
        """From the QKV projection's output (B, T, (heads + 2 kv) d / tp) to the output
        projection's input (B, T, heads d / tp): the rotations, v's copy and the kernel, what
        selective recomputation runs again."""
        b, t, _ = qkv.shape
        d, kv = self.spec.head_dim, self.kv_heads
        queries = self.heads // kv  # query heads per KV head
        qkv = qkv.view(b, t, kv, queries + 2, d)  # per KV head: its queries, key, value
        q, k, v = qkv.split([queries, 1, 1], dim=3)
        q = q.permute(0, 2, 3, 1, 4)  # (B, kv, queries, T, d)
        k, v = k.squeeze(3).transpose(1, 2), v.squeeze(3).transpose(1, 2)  # (B, kv, T, d)
        if self.spec.arch == "llama":
            # The rotations are new tensors: v would be the only view left of the projection's
            # output, and the attention would keep all of it, not only v's rows, for backward.
            q, k, v = self.rotary(q), self.rotary(k), v.contiguous()
        q = q.flatten(1, 2)  # (B, heads, T, d), head kv * queries + j: each KV head's queries
        # grouped-query attention: query head i attends with KV head i // queries, as
        # repeat_interleave would give, without the copies
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=queries > 1)
        return out.transpose(1, 2).reshape(b, t, self.heads * d)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.arch == "gpt":
            approximate = "tanh" if self.spec.activation == "gelu_tanh" else "none"
            return self.fc2(F.gelu(self.fc1(x), approximate=approximate))
        return self.down(_SwiGlu.apply(self.gate_up(x)))  # (B, T, 2f/tp) -> (B, T, f/tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:  # x: (B, T/t, h), this rank's tokens
            x = x + self.attention(self._gathered_norm(self.norm1, x))
            return x + self.mlp(self._gathered_norm(self.norm2, x))
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))

    def _gathered_norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Sequence parallelism: ``norm`` of this rank's shard (B, T/t, h), gathered to the
        whole sequence (B, T, h) a column-parallel block reads."""
        return gather_from_sequence(replicated_on_shard(norm, x, self.group), self.group)


class Stage(nn.Module):
    """Layers [first, first + count) of the model on one TP rank; the first stage also embeds the
    tokens, the last also normalises, projects to the (vocabulary-parallel) logits and scores
    them.

    ``sequence_parallel`` (at TP > 1): the layers run on this rank's sequence shard. The first
    stage's embedding is reduce-scattered to it; another stage's input is the shard, as the
    previous stage's ranks send it by tokens (runtime.p2p); the last stage's final norm runs on
    the shard, gathered before the head; another stage's output is the shard, sent as it is.
    """

    def __init__(
        self,
        spec: ModelSpec,
        first: int,
        count: int,
        group,
        *,
        is_first: bool,
        is_last: bool,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.spec, self.first, self.group = spec, first, parallel_group(group)
        self.is_first, self.is_last = is_first, is_last
        sp = self.sequence_parallel = sequence_parallel and self.group is not None
        gpt = spec.arch == "gpt"
        if is_first:
            self.embed = VocabParallelEmbedding(spec.vocab, spec.hidden, group, sp)
            if gpt:
                self.pos = nn.Embedding(spec.position_rows, spec.hidden)
        rotary = None if gpt or count == 0 else rotary_of(spec)
        self.layers = nn.ModuleDict(
            {str(first + i): Layer(spec, group, rotary, sp) for i in range(count)}
        )
        if is_last:
            self.final_norm = norm_of(spec)
            # A head tied to the embedding: on a stage without the embedding it keeps a copy,
            # whose gradient the runtime adds to the embedding's.
            if not (spec.tied_head and is_first):
                self.head = nn.Parameter(torch.empty(spec.vocab // tp_size(group), spec.hidden))

    @property
    def head_weight(self) -> torch.Tensor:
        return self.head if hasattr(self, "head") else self.embed.weight

    def forward(self, x: torch.Tensor, recompute: Recompute = Recompute.NONE) -> torch.Tensor:
        """Tokens (B, T) on the first stage, hidden states (B, T, h) elsewhere (under sequence
        parallelism this rank's (B, T/t, h)); returns hidden states (the same), or this rank's
        logit shard (B, T, vocab/tp) on the last stage.

        ``recompute``, the stage's. Recompute.FULL: each layer is checkpointed on its own, as
        Megatron-LM does, so a micro-batch in flight keeps only its layers' inputs, and a
        backward rebuilds one layer at a time. Each layer's forward is run again whole (torch's
        early stop, which would skip the ops after the last saved tensor, is off): what
        spec.layer_ops prices. Recompute.SELECTIVE: each layer checkpoints its attention's inner
        part (Layer.inner_attention), rebuilt in the backward."""
        if self.is_first:
            tokens = x
            x = self.embed(tokens)  # sequence parallel: this rank's shard (B, T/t, h)
            if self.spec.arch == "gpt":
                x = x + self._positions(tokens.shape[1], tokens.device)
        for layer in self.layers.values():
            layer.checkpoint_attention = recompute is Recompute.SELECTIVE
        if recompute is Recompute.FULL:
            with set_checkpoint_early_stop(False):
                for layer in self.layers.values():
                    x = checkpoint(layer, x, use_reentrant=False)
        else:
            for layer in self.layers.values():
                x = layer(x)
        if self.is_last:
            x = F.linear(self._head_input(x), self.head_weight)
        return x

    def _positions(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """GPT's position embeddings of this rank's tokens: (T, h), or under sequence
        parallelism its shard's (T/t, h), their gradient summed over the group."""
        positions = torch.arange(seq_len, device=device)
        if not self.sequence_parallel:
            return self.pos(positions)
        shard = positions.chunk(tp_size(self.group))[tp_rank(self.group)]
        return replicated_on_shard(self.pos, shard, self.group)

    def _head_input(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm of ``x``, whole on every rank as the column-parallel head reads it:
        under sequence parallelism, normalised on the shard and gathered (Megatron-LM)."""
        if self.sequence_parallel:
            return gather_from_sequence(
                replicated_on_shard(self.final_norm, x, self.group), self.group
            )
        return copy_to(self.final_norm(x), self.group)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean token cross-entropy from this rank's logit shard."""
        start = tp_rank(self.group) * (self.spec.vocab // tp_size(self.group))
        return vocab_parallel_cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), start, self.group
        )

    @classmethod
    def build(
        cls,
        spec: ModelSpec,
        first: int,
        count: int,
        group,
        *,
        is_first: bool,
        is_last: bool,
        seed: int,
        device: torch.device | str = "cpu",
        sequence_parallel: bool = False,
    ) -> Stage:
        """The stage made on ``device`` with its TP shard of the seeded initial weights: laid
        out on the meta device (no memory), then only this stage's shards are allocated and
        filled, one parameter at a time."""
        with torch.device("meta"):
            stage = cls(
                spec,
                first,
                count,
                group,
                is_first=is_first,
                is_last=is_last,
                sequence_parallel=sequence_parallel,
            )
        stage.to_empty(device=device)
        for module in stage.modules():
            if isinstance(module, Rotary):  # the stage's one, shared by its layers
                module.reset_tables()
        rank, size = tp_rank(group), tp_size(group)
        table = parameter_table(spec)
        with torch.no_grad():
            for name, param in stage.full_parameters():
                layout = table[name]
                whole = layout.tp_dim is None or size == 1
                if whole and param.device.type == "cpu":  # drawn in place: no temporary
                    initial_value(layout, seed, out=param)
                    continue
                full = initial_value(layout, seed)
                param.copy_(full if whole else full.chunk(size, dim=layout.tp_dim)[rank])
        return stage

    def load_full(self, state: dict[str, torch.Tensor]) -> None:
        """Copy this stage's TP shard of the full-model weights in."""
        rank, size, table = tp_rank(self.group), tp_size(self.group), parameter_table(self.spec)
        with torch.no_grad():
            for name, param in self.full_parameters():
                param.copy_(shard(table[name], state[name], rank, size))

    def full_name(self, name: str) -> str:
        """This stage's parameter name as the full model names it (hethub.spec.parameters): the
        module's own name, but for the output projection, where it is tied to the embedding."""
        if name == "head":
            return "embed.weight" if self.spec.tied_head else "head.weight"
        return name

    def full_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This stage's parameters by full-model name, sorted: the order in which every TP rank
        of a stage runs its per-parameter collectives (gradient sync, checkpoint gathers)."""
        return sorted((self.full_name(n), p) for n, p in self.named_parameters())


class StageChunks(nn.Module):
    """One rank's chunks of the model (interleaved 1F1B: stage s of p holds the model's chunks
    s, s + p, ...; otherwise one chunk): each a Stage, trained as one module. Their parameters
    have distinct full-model names, so the gradient sync, the optimizer and checkpoints see the
    rank's parameters as one stage's."""

    def __init__(self, chunks: list[Stage]) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(chunks)

    def full_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """As Stage.full_parameters, over every chunk."""
        named = [pair for chunk in self.chunks for pair in chunk.full_parameters()]
        return sorted(named, key=lambda pair: pair[0])
