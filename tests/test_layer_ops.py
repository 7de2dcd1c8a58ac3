"""spec.layer_ops, the layer's inventory the predictor prices, against what the runtime's Layer
really dispatches and keeps: its forward and backward traced under a TorchDispatchMode, every
operation (views and aliases aside, as profiler.op_counts counts them) with the bytes it reads
and writes and a GEMM's or the attention's FLOPs, and the bytes its forward saves for backward,
counted by storage. A change to the layer that changes any of these fails here until
spec/layer_ops.py says the same."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from hethub.profiler.op_counts import NO_KERNEL
from hethub.runtime.model import Layer
from hethub.runtime.spawn import run_ranks
from hethub.spec.layer_ops import layer_ops
from hethub.spec.model import ModelSpec
from hethub.spec.ops import Kernels, Op, OpKind
from hethub.spec.plan import Precision, Recompute

GEMMS = {"mm", "addmm"}
COLLECTIVES = {"allreduce_", "_allgather_base_", "_reduce_scatter_base_"}
ALLOCATIONS = {"empty", "empty_like", "empty_strided"}
"""Operations that only allocate: they read and write no bytes."""


def spec(arch: str, *, hidden=64, heads=4, kv_heads=4, ffn=None, seq=16) -> ModelSpec:
    return ModelSpec(
        name=f"test-{arch}",
        arch=arch,
        hidden=hidden,
        layers=1,
        heads=heads,
        kv_heads=kv_heads,
        ffn_hidden=ffn or (4 * hidden if arch == "gpt" else 3 * hidden // 2),
        vocab=128,
        seq_len=seq,
    )


LLAMA = spec("llama")
LLAMA_GQA = spec("llama", kv_heads=2)
GPT = spec("gpt")
QWEN2 = dataclasses.replace(LLAMA_GQA, name="test-qwen2", qkv_bias=True)  # q/k/v biases only
LLAMA_BIASED = dataclasses.replace(LLAMA_GQA, name="test-llama-bias", qkv_bias=True, o_bias=True)
GPT2 = dataclasses.replace(GPT, name="test-gpt2", activation="gelu_tanh")


def addressed_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the elements ``tensor`` addresses, a broadcast (stride 0) dimension once."""
    elements = 1
    for size, stride in zip(tensor.shape, tensor.stride(), strict=True):
        elements *= size if stride else 1
    return elements * tensor.element_size()


def traced_op(func, args: tuple, kwargs: dict, out) -> Op:
    """``func``'s call as spec.layer_ops describes one: bytes of every tensor read and written,
    a GEMM's FLOPs from its operands' shapes, causal attention's from q's."""
    name = func.overloadpacket.__name__
    if name in ALLOCATIONS:
        return Op(name, OpKind.MEMORY, 0, 0)
    out_args = {arg.name for arg in func._schema.arguments if arg.is_out}  # written, not read
    read_kwargs = {key: value for key, value in kwargs.items() if key not in out_args}
    inputs = [t for t in tree_flatten((args, read_kwargs))[0] if isinstance(t, torch.Tensor)]
    outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    read = sum(map(addressed_bytes, inputs))
    written = sum(map(addressed_bytes, outputs))
    if name in GEMMS:
        a, b = inputs[-2:]  # addmm's bias comes first
        (rows, inner), cols = a.shape, b.shape[1]
        return Op(name, OpKind.GEMM, read, written, 2 * rows * inner * cols, min(rows, inner, cols))
    if "scaled_dot_product" in name:
        # backward: (grad_out, q, ...); forward: (q, ...); every q is (B, heads, T, d)
        q = args[1] if name.endswith("_backward") else args[0]
        batch, heads, seq, head_dim = q.shape
        flops = 2 * batch * heads * head_dim * seq * (seq + 1)  # causal: T(T+1)/2 pairs, x 2 x 2
        flops = int(flops * 2.5) if name.endswith("_backward") else flops
        return Op(name, OpKind.ATTENTION, read, written, flops, min(seq, head_dim))
    kind = OpKind.COLLECTIVE if name in COLLECTIVES else OpKind.MEMORY
    return Op(name, kind, read, written)


class Trace(TorchDispatchMode):
    """Every operation dispatched while active, views and aliases aside."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not func.is_view and func.overloadpacket.__name__ not in NO_KERNEL:
            self.ops.append(traced_op(func, args, kwargs, out))
        return out


class SavedBytes:
    """Bytes of the distinct storages saved for backward while active, ``ignored``'s aside."""

    def __init__(self, ignored: list[torch.Tensor]) -> None:
        self.ignored = {t.untyped_storage().data_ptr() for t in ignored}
        self.kept: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.ignored:
            self.kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def total(self) -> int:
        return sum(self.kept.values())


def traced_layer(
    model: ModelSpec, group, precision: Precision, micro_batch: int, recompute: Recompute
) -> tuple[list[Op], list[Op], int]:
    """One forward and backward of the runtime's Layer: its forward's and its backward's
    operations, and the bytes its forward saved (its parameters and buffers aside)."""
    torch.manual_seed(0)
    dtype = getattr(torch, precision.dtype_name)
    layer = Layer(model, group)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(std=0.02)
    layer.to(dtype)
    layer.checkpoint_attention = recompute is Recompute.SELECTIVE  # as its Stage sets it
    x = torch.randn(micro_batch, model.seq_len, model.hidden, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    saved = SavedBytes([*layer.parameters(), *layer.buffers()])
    hooks = torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda tensor: tensor)
    with Trace() as forward, hooks:
        y = checkpoint(layer, x, use_reentrant=False) if recompute is Recompute.FULL else layer(x)
    with Trace() as backward:
        y.backward(grad)
    return forward.ops, backward.ops, saved.total


def assert_same_ops(traced: list[Op], described: tuple[Op, ...], what: str) -> None:
    """The same operations, each with the same bytes and FLOPs, in any order: the difference
    is printed both ways."""
    traced_set, described_set = collections.Counter(traced), collections.Counter(described)
    assert traced_set == described_set, (
        f"{what}: traced but not described {dict(traced_set - described_set)}; "
        f"described but not traced {dict(described_set - traced_set)}"
    )


def check_layer(model, group, tp, precision, micro_batch=2, recompute=Recompute.NONE) -> None:
    forward, backward, saved = traced_layer(model, group, precision, micro_batch, recompute)
    described = layer_ops(model, tp, micro_batch, precision, Kernels.CPU, recompute)
    what = f"{model.name} kv_heads={model.kv_heads} tp={tp} {precision} {recompute}"
    assert_same_ops(forward, described.forward, f"{what} forward")
    assert_same_ops(backward, described.backward, f"{what} backward")
    if recompute is not Recompute.FULL:
        assert saved == described.saved_bytes, what


@pytest.mark.parametrize("precision", [Precision.FP32, Precision.BF16])
@pytest.mark.parametrize(
    "model",
    [LLAMA, LLAMA_GQA, GPT, QWEN2, LLAMA_BIASED, GPT2],
    ids=["llama", "llama-gqa", "gpt", "qwen2", "llama-bias", "gpt2"],
)
def test_the_description_is_what_the_layer_dispatches_at_tp1(model, precision):
    check_layer(model, None, 1, precision)


def test_recomputation_runs_the_forward_again_inside_the_backward():
    # The runtime checkpoints a stage's chunk; torch's early stop then skips the tail of its
    # last layer only: one layer checkpointed alone is priced, and traced, without it.
    with set_checkpoint_early_stop(False):
        check_layer(LLAMA_GQA, None, 1, Precision.BF16, recompute=Recompute.FULL)


@pytest.mark.parametrize("precision", [Precision.FP32, Precision.BF16])
@pytest.mark.parametrize("model", [LLAMA, LLAMA_GQA, GPT], ids=["llama", "llama-gqa", "gpt"])
def test_selective_recomputation_runs_the_inner_attention_again_and_keeps_less(model, precision):
    check_layer(model, None, 1, precision, recompute=Recompute.SELECTIVE)
    # What it saves is the kernel's log-sum-exp, fp32, one per query of each head: the QKV
    # output it keeps instead of q, k and v has their bytes, and the output projection keeps
    # the kernel's output either way.
    kept = {r: layer_ops(model, 1, 2, precision, Kernels.CPU, r).saved_bytes for r in Recompute}
    log_sum_exp = 2 * model.heads * model.seq_len * 4
    assert kept[Recompute.NONE] - kept[Recompute.SELECTIVE] == log_sum_exp


SAVED_SHAPES = [
    {"hidden": 64, "heads": 4, "seq": 16},
    {"hidden": 96, "heads": 6, "seq": 32},
    {"hidden": 128, "heads": 8, "seq": 24},
]


@pytest.mark.parametrize("shape", SAVED_SHAPES, ids=lambda s: f"h{s['hidden']}-s{s['seq']}")
@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_saved_bytes_are_the_description_s_at_three_shapes(arch, shape):
    model = spec(arch, kv_heads=shape["heads"] // 2 if arch == "llama" else shape["heads"], **shape)
    for precision in (Precision.BF16, Precision.FP32):
        for recompute in (Recompute.NONE, Recompute.SELECTIVE):
            *_, saved = traced_layer(model, None, precision, 3, recompute)
            described = layer_ops(model, 1, 3, precision, Kernels.CPU, recompute).saved_bytes
            assert saved == described, (arch, shape, precision, recompute)


def _tp2_rank(rank: int, world: int) -> None:
    group = dist.new_group(list(range(world)))
    for model in (LLAMA_GQA, GPT):
        for precision in (Precision.FP32, Precision.BF16):
            check_layer(model, group, world, precision)
        check_layer(model, group, world, Precision.BF16, recompute=Recompute.SELECTIVE)
    check_layer(LLAMA_BIASED, group, world, Precision.FP32)  # o's bias added after the sum


def test_the_description_is_what_the_layer_dispatches_at_tp2():
    run_ranks(_tp2_rank, 2, purpose="layer_ops at TP 2", timeout_s=120)
