"""A rank's weights and main gradients in flat buffers (runtime.flat_layout, runtime.precision):
the layout, the accumulation over micro-batches against plain autograd's, and what a step costs
in Python hooks and torch operators."""

from __future__ import annotations

import pytest
import torch
from benchmark_scripts import load_benchmark

from hethub.profiler.op_counts import OpCounter
from hethub.runtime.flat_layout import FlatLayout
from hethub.runtime.model import Stage, StageChunks
from hethub.runtime.optimizer import PlainAdamW
from hethub.runtime.precision import MasterWeights
from hethub.spec import load_model

SPEC = load_model("tiny-llama")
MICRO_BATCHES = 3


def test_buckets_come_first_each_contiguous_and_padded_to_the_shards():
    shapes = {"a": (2, 3), "b": (5,), "c": (4,), "d": (1,), "e": (7,)}
    layout = FlatLayout(shapes, [["c", "a"], ["e"]], shards=4)
    # bucket 0: c then a (10 elements) padded to 12; bucket 1: e (7) padded to 8; then b and d
    assert layout.spans == {"c": (0, 4), "a": (4, 10), "e": (12, 19), "b": (20, 25), "d": (25, 26)}
    assert [(s.start, s.used, s.stop) for s in layout.buckets] == [(0, 10, 12), (12, 19, 20)]
    assert layout.unbucketed == ("b", "d") and layout.numel == 26
    assert layout.padding() == [(10, 12), (19, 20)]
    assert [layout.shard(0, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert [layout.shard(1, r) for r in range(4)] == [(12, 14), (14, 16), (16, 18), (18, 20)]
    flat = torch.arange(26.0)
    assert torch.equal(layout.view(flat, "a"), torch.arange(4.0, 10.0).view(2, 3))
    assert torch.equal(layout.bucket(flat, 1, padded=True), torch.arange(12.0, 20.0))
    assert torch.equal(layout.view(flat[12:20], "e", offset=12), torch.arange(12.0, 19.0))


def test_a_layout_refuses_an_unknown_or_twice_bucketed_parameter():
    with pytest.raises(ValueError, match="z is not one of the rank's"):
        FlatLayout({"a": (1,)}, [["z"]])
    with pytest.raises(ValueError, match="a is in two buckets"):
        FlatLayout({"a": (1,)}, [["a"], ["a"]])


def two_chunks() -> StageChunks:
    """A rank's two chunks of an interleaved tiny-llama: layers 0-1 with the embedding, layers
    4-5 with the head."""
    return StageChunks(
        [
            Stage.build(SPEC, 0, 2, None, is_first=True, is_last=False, seed=3),
            Stage.build(SPEC, 4, 2, None, is_first=False, is_last=True, seed=3),
        ]
    )


def micro_batch(j: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens (B, T + 1), and the hidden states (B, T, h) the second chunk takes with the
    gradient the first chunk's output gets."""
    gen = torch.Generator().manual_seed(j)
    tokens = torch.randint(0, SPEC.vocab, (2, SPEC.seq_len + 1), generator=gen)
    hidden = torch.randn(2, SPEC.seq_len, SPEC.hidden, generator=gen)
    return tokens, hidden, torch.randn(2, SPEC.seq_len, SPEC.hidden, generator=gen)


def backward(stage: StageChunks, chunk: int, j: int, dtype: torch.dtype) -> None:
    """Chunk ``chunk``'s backward of micro-batch ``j``, as the pipeline runs one."""
    tokens, hidden, grad = micro_batch(j)
    if chunk == 0:
        stage.chunks[0](tokens[:, :-1]).backward(grad.to(dtype))
    else:
        last = stage.chunks[1]
        last.loss(last(hidden.to(dtype).requires_grad_()), tokens[:, 1:]).backward()


def buckets_of(stage: StageChunks) -> list[list[str]]:
    """Two buckets mixing both chunks' parameters (as the sync's, sorted by name), the last
    few parameters in none."""
    names = [name for name, _ in stage.full_parameters()]
    return [names[: len(names) // 2], names[len(names) // 2 : -3]]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_micro_batch_gradients_sum_in_fp32_into_the_flat_main_gradients(precision):
    stage, twin = two_chunks(), two_chunks()
    weights = MasterWeights(stage, precision, buckets_of(stage), shards=3)
    dtype = weights.compute_dtype
    twin.to(dtype)
    # every weight computes in the precision, as a view of the one flat buffer
    for name, param in stage.full_parameters():
        assert param.dtype == dtype, name
        assert param.untyped_storage().data_ptr() == weights.flat.untyped_storage().data_ptr()
    # plain autograd's gradient of each backward, summed in fp32 (Megatron's main_grad)
    expected = {name: torch.zeros(p.shape) for name, p in twin.full_parameters()}
    for j in range(MICRO_BATCHES):
        for c in (1, 0):
            backward(twin, c, j, dtype)
            for name, p in twin.full_parameters():
                if p.grad is not None:
                    expected[name] += p.grad.float()
                p.grad = None
    # The main gradients are never zeroed: a step's first backward copies its gradients in.
    # Garbage left from a "last step" must not leak into this one.
    for name, _ in weights.named:
        weights.grad(name).fill_(float("nan"))
    weights.zero_grad()
    for j in range(MICRO_BATCHES):
        for c in (1, 0):
            backward(stage, c, j, dtype)
    for name, master in weights.named:
        assert torch.equal(weights.grad(name), expected[name]), name
        assert master.grad.data_ptr() == weights.grad(name).data_ptr(), name  # still views
    for name, param in stage.full_parameters():
        if precision == "bf16":  # each backward's own gradients dropped once moved
            assert param.grad is None, name
        else:  # the main gradient itself, into which autograd adds the later micro-batches'
            assert param.grad.data_ptr() == weights.grad(name).data_ptr(), name
    for start, stop in weights.layout.padding():  # what a sharded sync sums and steps: zeros
        assert not weights.main_grads[start:stop].any()
    # only one hook a chunk, the flush's
    hooks = sum(len(p._post_accumulate_grad_hooks or {}) for p in stage.parameters())
    assert hooks == 2


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_weight_given_no_gradient_has_a_zero_main_gradient_not_the_last_step_s(precision):
    stage = two_chunks()
    weights = MasterWeights(stage, precision)
    frozen = "layers.4.norm2.weight"
    dict(stage.full_parameters())[frozen].requires_grad_(False)
    weights.main_grads.fill_(float("nan"))
    weights.zero_grad()
    for j in range(2):
        backward(stage, 1, j, weights.compute_dtype)
    assert not weights.grad(frozen).any()
    assert weights.grad("layers.4.norm1.weight").isfinite().all()


def test_a_bucket_done_mid_step_is_left_alone_by_later_flushes():
    # An overlapped sync sums a bucket as soon as its last gradient is given; a later backward's
    # flush must not write into it while the collective may be reading it.
    stage = two_chunks()
    weights = MasterWeights(stage, "bf16", buckets_of(stage))
    weights.zero_grad()
    backward(stage, 1, 0, torch.bfloat16)
    weights.bucket_done(0)
    summed = weights.main_grads.clone()
    backward(stage, 1, 1, torch.bfloat16)
    assert torch.equal(weights.bucket_grads(0), weights.layout.bucket(summed, 0))
    assert not torch.equal(weights.bucket_grads(1), weights.layout.bucket(summed, 1))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_update_is_one_fused_adamw_one_decay_and_one_copy_whatever_the_parameter_count(
    precision,
):
    stage, twin = two_chunks(), two_chunks()
    weights = MasterWeights(stage, precision)
    reference = MasterWeights(twin, precision)
    optimizer = PlainAdamW(weights, lr=1e-2, weight_decay=0.1)
    # no decay on norms and biases (runtime.optimizer.takes_weight_decay)
    groups = [
        {"params": [p for p in reference.parameters() if p.dim() > 1], "weight_decay": 0.1},
        {"params": [p for p in reference.parameters() if p.dim() == 1], "weight_decay": 0.0},
    ]
    per_tensor = torch.optim.AdamW(groups, lr=1e-2, fused=True)
    for w in (weights, reference):
        w.zero_grad()
        for c in (1, 0):
            backward(w.stage, c, 0, w.compute_dtype)
    optimizer.step()  # the first step makes the state
    with OpCounter() as counted:
        optimizer.step()
    per_tensor.step()
    per_tensor.step()
    reference.copy_to_model()
    assert optimizer.adamw.defaults["fused"]  # torch has a fused AdamW for the CPU
    # stepping the flat buffer steps each parameter exactly as AdamW over them one by one
    for (name, param), (_, twin_param) in zip(
        stage.full_parameters(), twin.full_parameters(), strict=True
    ):
        assert torch.equal(param, twin_param), name
    assert len(weights.named) > 20
    copies = 1 if precision == "bf16" else 0  # the masters into the bf16 weights
    assert counted.ops.pop("_fused_adamw_") == 1 and counted.ops.pop("copy_", 0) == copies
    assert counted.ops.pop("_foreach_mul_") == 1  # the weight decay, over the decayed spans
    assert sum(counted.ops.values()) <= 3, counted.ops  # the step counters' add, profiling marks


def _count_step(rank, world, precision, kind):
    return load_benchmark("step_op_counts").count_step(rank, world, precision, kind)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_data_parallel_step_calls_no_hook_nor_operator_per_parameter(precision):
    from hethub.runtime.spawn import run_ranks

    plain, overlapped, sharded = (
        run_ranks(_count_step, 2, precision, kind, purpose="test")[0]
        for kind in ("plain", "overlapped", "sharded")
    )
    params, micro_batches = plain["parameters"], 2
    # accumulation: one hook a backward (its flush); an overlapped sync hooks each parameter
    # once a step, in its chunk's last backward
    flushes = micro_batches
    assert plain["hook_calls"] == flushes
    assert overlapped["hook_calls"] == sharded["hook_calls"] == flushes + params
    # the sync sums buckets in place: one all-reduce (started during the backwards if
    # overlapped); the sharded one's reduce-scatter, during the backwards too
    assert plain["sync_ops"] == {"allreduce_": 1} and overlapped["sync_ops"] == {}
    for update in (plain["update_ops"], overlapped["update_ops"], sharded["update_ops"]):
        assert update.get("_fused_adamw_") == 1 and sum(update.values()) <= 6, update
