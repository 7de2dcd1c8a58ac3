"""Every formula of the predictor against a hand-computed case."""

from __future__ import annotations

import dataclasses

import pytest

from hethub.errors import SpecError
from hethub.predictor import comm, compute, memory
from hethub.predictor.calibration import Calibration, default_calibration, fitted_bounds
from hethub.predictor.stage import LayerShape
from hethub.spec import lookup, parse_cluster, parse_model
from hethub.spec.accelerator import catalog, parse_accelerator
from hethub.spec.layer_ops import layer_ops
from hethub.spec.ops import Kernels, OpKind, trainer_bytes
from hethub.spec.parameters import parameter_counts
from hethub.spec.plan import Precision, Recompute
from hethub.spec.schedules import Schedule, in_flight_micro_batches

BF16 = Precision.BF16

CAL = Calibration(
    dispatch_us=5,
    matmul_ramp_us=10,
    link_efficiency=0.5,
    network_efficiency=0.25,
    collective_latency_us=2,
    step_overhead_ms=1,
)
GPT = parse_model(
    {"arch": "gpt", "hidden": 1024, "layers": 4, "heads": 16, "vocab": 1000, "seq_len": 512},
    "",
    "g",
)
LLAMA = parse_model(
    {
        "arch": "llama",
        "hidden": 1024,
        "layers": 4,
        "heads": 16,
        "kv_heads": 4,
        "ffn_hidden": 2816,
        "vocab": 1000,
        "seq_len": 512,
    },
    "",
    "l",
)
A100 = lookup("a100-80gb")
ROUND = parse_accelerator(
    {
        "name": "round",
        "vendor": "nvidia",
        "bf16_tflops": 312,
        "memory_gb": 80,
        "memory_bw_gb_s": 2000,
        "efficiency": {
            "gemm": 0.5,
            "sustained": 0.5,
            "attention": 0.2,
            "memory": 0.5,
            "launch_us": 1,
            "source": "round figures for the test",
        },
    },
    "test",
    "accelerator",
)
"""Round efficiency figures: a GEMM at 0.25 of 312 TFLOP/s, bytes at 1000 GB/s."""


def test_calibration_comes_from_the_catalog_and_stays_inside_its_bounds():
    cal = default_calibration()
    for name in ("link_efficiency", "network_efficiency"):
        assert 0 < getattr(cal, name) <= 1, name
    bounds = fitted_bounds()
    # What a refit may move: the framework's dispatch, a GEMM's tail, latency, step overhead;
    # never a device's efficiency, and never the links' shares (held at published figures).
    assert set(bounds) == {
        "dispatch_us",
        "matmul_ramp_us",
        "collective_latency_us",
        "step_overhead_ms",
    }
    for name, bound in bounds.items():
        assert bound.low <= getattr(cal, name) <= bound.high, name
        assert bound.reason, name
    assert len([f for f in dataclasses.fields(cal) if f.init]) == 6


def test_every_catalog_device_has_its_efficiency_and_says_what_it_inherited():
    for name, device in catalog().items():
        e = device.efficiency
        for figure in ("gemm", "sustained", "attention", "memory"):
            assert 0 < getattr(e, figure) <= 1, (name, figure)
        assert e.launch_us > 0 and e.source, name  # a measured figure: its source says whose
    # Measured devices have their own GEMM figure; one with none inherits its vendor's, and its
    # source says so.
    assert "gemm" not in lookup("h100").efficiency.inherited
    assert lookup("h100").efficiency.gemm != lookup("mi300x").efficiency.gemm
    l40s = lookup("l40s").efficiency
    assert "gemm" in l40s.inherited and "nvidia's default" in l40s.source


def test_an_inline_accelerator_may_give_part_of_its_efficiency():
    inline = parse_accelerator(
        {
            "name": "x",
            "vendor": "amd",
            "bf16_tflops": 100,
            "memory_gb": 10,
            "efficiency": {"gemm": 0.7, "source": "my own GEMM sweep"},
        },
        "c.yaml",
        "groups[0].accelerator",
    )
    assert inline.efficiency.gemm == 0.7
    assert inline.efficiency.inherited == ("sustained", "attention", "memory", "launch_us")
    assert (
        "my own GEMM sweep" in inline.efficiency.source
        and "amd's default" in inline.efficiency.source
    )
    with pytest.raises(SpecError, match=r"efficiency.gemm"):
        parse_accelerator(
            {
                "name": "x",
                "vendor": "amd",
                "bf16_tflops": 1,
                "memory_gb": 1,
                "efficiency": {"gemm": 1.5},
            },
            "c.yaml",
            "groups[0].accelerator",
        )


def test_gemm_time_is_a_roofline_of_its_flops_and_its_bytes():
    # 1 TFLOP at 0.5 x 0.5 of 312 TFLOP/s, 1 GB at 0.5 of 2000 GB/s, plus the 10 us tail.
    assert compute.gemm_time(1e12, 1e9, ROUND, CAL, BF16) == pytest.approx(
        1e12 / (312e12 * 0.25) + 1e9 / 1000e9 + 10e-6
    )
    # Of two GEMMs of the same FLOPs, the thin one (more bytes a FLOP) is slower.
    square = compute.gemm_time(2 * 4096**3, 3 * 4096**2 * 2, ROUND, CAL, BF16)
    thin = compute.gemm_time(2 * 4096**3, (2 * 4096 * 64 + 4096**2) * 2 * 64, ROUND, CAL, BF16)
    assert thin > square


def test_attention_runs_at_its_own_measured_rate():
    assert compute.attention_time(1e12, 0, ROUND, BF16) == pytest.approx(1e12 / (312e12 * 0.1))


def test_memory_time_is_bytes_over_effective_bandwidth():
    assert compute.memory_time(1000e9, ROUND) == pytest.approx(1.0)


def test_gpt_layer_gemms_by_hand():
    b, s, h, t = 2, 512, 1024, 2
    tokens = b * s
    gemms = compute.layer_gemms(GPT, t, b)
    assert [f for f, _ in gemms] == pytest.approx(
        [
            2 * tokens * h * 3 * h / t,
            2 * tokens * s * h / t,
            2 * tokens * s * h / t,
            2 * tokens * h * h / t,
            2 * tokens * h * 4 * h / t,
            2 * tokens * 4 * h * h / t,
        ]
    )
    # Narrowest dimensions: QKV 1536 wide per rank, attention over 64 channels per head, projection
    # over h/t input channels, MLP over 4h/t.
    assert [d for _, d in gemms] == [1024, 64, 64, 512, 1024, 1024]
    # The classic 24 b s h^2 + 4 b s^2 h per layer forward.
    assert sum(f for f, _ in compute.layer_gemms(GPT, 1, b)) == pytest.approx(
        24 * b * s * h * h + 4 * b * s * s * h
    )


def test_llama_layer_gemms_count_grouped_query_attention_and_swiglu():
    tokens, h, kv, f = 512, 1024, 256, 2816
    flops = [f_ for f_, _ in compute.layer_gemms(LLAMA, 1, 1)]
    assert flops[0] == pytest.approx(2 * tokens * h * (h + 2 * kv))  # one QKV GEMM
    assert flops[4:] == pytest.approx([2 * tokens * h * 2 * f, 2 * tokens * f * h])  # gate|up, down


def test_gpt_layer_memory_traffic_by_hand():
    # Forward on an accelerator, bf16, TP 1: two LayerNorms (read x and the weight and bias,
    # write y and fp32 mean and 1/std per token), GELU (read and write 4h), two residual adds
    # (read two, write one); the attention never writes its scores.
    b, s, h = 1, 512, 1024
    tokens, e = b * s, 2
    norms = 2 * (2 * tokens * h * e + 2 * h * e + 2 * tokens * 4)
    gelu = 2 * tokens * 4 * h * e
    adds = 2 * 3 * tokens * h * e
    ops = layer_ops(GPT, 1, b, BF16, Kernels.FUSED).forward
    assert sum(op.bytes_moved for op in ops if op.kind is OpKind.MEMORY) == norms + gelu + adds


def test_megatron_gpt_layer_memory_traffic_by_hand():
    # Megatron-LM's layer (the measured runs'), forward, bf16, TP 2: two LayerNorms; the
    # context laid out (read and write h/t; q, k and v are views); the scores (b a/t s^2) read and
    # written by the softmax and by the dropout, which writes its 1-byte mask; two
    # bias-dropout-adds (read the output, its bias and the residual, write the sum and a mask);
    # the bias-GELU (read and write 4h/t and the bias).
    b, s, h, t, a = 2, 512, 1024, 2, 16
    tokens, e = b * s, 2
    scores = b * a // t * s * s
    norms = 2 * (2 * tokens * h * e + 2 * h * e + 2 * tokens * 4)
    layouts = 2 * tokens * h // t * e
    softmax_dropout = 2 * scores * e + 2 * scores * e + scores
    bias_dropout_adds = 2 * (3 * tokens * h * e + h * e + tokens * h)
    bias_gelu = 2 * tokens * 4 * h // t * e + 4 * h // t * e
    ops = layer_ops(GPT, t, b, BF16, Kernels.MEGATRON_LM).forward
    assert sum(op.bytes_moved for op in ops if op.kind is OpKind.MEMORY) == (
        norms + layouts + softmax_dropout + bias_dropout_adds + bias_gelu
    )


def _accumulate_s(model, kernels, tp=1):
    """A micro-batch's weight gradients joining the step's: bytes the trainer moves a parameter."""
    per_layer = parameter_counts(model).layer / tp
    return compute.memory_time(per_layer * trainer_bytes(kernels, BF16).accumulation, ROUND)


def test_a_layer_told_its_kernels_is_priced_by_them():
    # Megatron-LM's layer, launch-bound: 14 operations forward, where the runtime's layer on an
    # accelerator's own kernels has 10; the backward, 31 against 19 (and each trainer's
    # gradient accumulation: Megatron-LM's 16-bit in place, hethub's into fp32 main gradients).
    slow_host = dataclasses.replace(CAL, dispatch_us=999)
    told = compute.layer_cost(
        LayerShape(GPT, 1, 1, Recompute.NONE, BF16), ROUND, slow_host, 0.0, Kernels.MEGATRON_LM
    )
    own = compute.layer_cost(LayerShape(GPT, 1, 1, Recompute.NONE, BF16), ROUND, slow_host, 0.0)
    assert (told.forward_s, told.backward_s) == pytest.approx(
        (14e-3, 31e-3 + _accumulate_s(GPT, Kernels.MEGATRON_LM))
    )
    assert (own.forward_s, own.backward_s) == pytest.approx(
        (10e-3, 19e-3 + _accumulate_s(GPT, Kernels.FUSED))
    )
    assert dataclasses.astuple(trainer_bytes(Kernels.FUSED, BF16)) == (10, 4, 30)
    assert dataclasses.astuple(trainer_bytes(Kernels.MEGATRON_LM, BF16)) == (6, 2, 52)


def test_layer_takes_the_larger_of_host_and_device_time():
    tiny = parse_model(
        {"arch": "gpt", "hidden": 64, "layers": 1, "heads": 4, "vocab": 100, "seq_len": 16}, "", "t"
    )
    slow_host = dataclasses.replace(CAL, dispatch_us=999)
    cost = compute.layer_cost(LayerShape(tiny, 1, 1, Recompute.NONE, BF16), ROUND, slow_host, 0.0)
    # Launch-bound. Forward: 2 norms, QKV, attention, projection, 2 adds, fc1, GELU, fc2: 10.
    # Backward: 2 norms, 4 GEMMs each x 2 and their 4 bias sums, attention, the QKV
    # gradients' concatenation, GELU, 2 gradient sums: 19.
    accumulate = _accumulate_s(tiny, Kernels.FUSED)
    assert cost.forward_s == pytest.approx(10 * 1000e-6)
    assert cost.backward_s == pytest.approx(19 * 1000e-6 + accumulate)
    recomputed = compute.layer_cost(
        LayerShape(tiny, 1, 1, Recompute.FULL, BF16), ROUND, slow_host, 0.0
    )
    assert recomputed.backward_s == pytest.approx(29 * 1000e-6 + accumulate)
    big = compute.layer_cost(
        LayerShape(GPT, 1, 8, Recompute.NONE, BF16), ROUND, CAL, 0.0
    )  # device-bound
    ops = layer_ops(GPT, 1, 8, BF16, Kernels.FUSED)
    passes = (
        (big.forward_s, ops.forward, 0.0),
        (big.backward_s, ops.backward, _accumulate_s(GPT, Kernels.FUSED)),
    )
    for device_s, pass_ops, joined in passes:
        gemms = sum(
            compute.gemm_time(op.flops, op.bytes_moved, ROUND, CAL, BF16)
            for op in pass_ops
            if op.kind is OpKind.GEMM
        )
        attention = sum(
            compute.attention_time(op.flops, op.bytes_moved, ROUND, BF16)
            for op in pass_ops
            if op.kind is OpKind.ATTENTION
        )
        moved = sum(op.bytes_moved for op in pass_ops if op.kind is OpKind.MEMORY)
        assert device_s == pytest.approx(
            gemms + attention + compute.memory_time(moved, ROUND) + joined
        )


def test_a_cpu_prices_its_own_kernels():
    # The CPU's RMSNorm runs as separate operations: more launches than an accelerator's.
    cpu = lookup("cpu")
    assert compute.kernels_of(cpu) is Kernels.CPU and compute.kernels_of(A100) is Kernels.FUSED
    slow_host = dataclasses.replace(CAL, dispatch_us=1000)
    on_cpu = compute.layer_cost(LayerShape(LLAMA, 1, 1, Recompute.NONE, BF16), cpu, slow_host, 0.0)
    cpu_ops = layer_ops(LLAMA, 1, 1, BF16, Kernels.CPU)
    assert on_cpu.forward_s >= len(cpu_ops.forward) * 1000e-6
    assert len(cpu_ops.forward) > len(layer_ops(LLAMA, 1, 1, BF16, Kernels.FUSED).forward)


def test_ring_allreduce_by_hand():
    # 4 ranks, 400 MB at 100 GB/s: 6 steps of 100 MB (1 ms each) plus 6 latencies of 2 us.
    assert comm.ring_allreduce_time(400e6, 4, 100e9, CAL) == pytest.approx(6 * (1e-3 + 2e-6))
    assert comm.ring_allreduce_time(400e6, 1, 100e9, CAL) == 0.0


def _cluster(**group):
    base = {
        "name": "g",
        "accelerator": "a100-80gb",
        "nodes": 4,
        "devices_per_node": 8,
        "network_gbps": 800,
    }
    return parse_cluster({"groups": [{**base, **group}]}, "test")


def test_allreduce_inside_a_node_uses_the_link_and_across_nodes_is_hierarchical():
    group = _cluster().groups[0]
    link = 300e9 * 0.5
    assert comm.group_allreduce_time(8e6, 8, group, CAL) == pytest.approx(
        comm.ring_allreduce_time(8e6, 8, link, CAL)
    )
    # 32 ranks over 4 nodes: ring of 8 on the link, then a ring of 4 over 1/8 of the bytes on each
    # device's share of the network (800 Gbit/s / 8 / 8 devices = 12.5 GB/s, at 0.25 efficiency).
    network = 800 / 8 / 8 * 1e9 * 0.25
    expected = comm.ring_allreduce_time(8e6, 8, link, CAL) + comm.ring_allreduce_time(
        1e6, 4, network, CAL
    )
    assert comm.group_allreduce_time(8e6, 32, group, CAL) == pytest.approx(expected)


def test_bridge_between_vendors_is_three_copies_in_series():
    cluster = parse_cluster(
        {
            "groups": [
                {"name": "nv", "accelerator": "a100-80gb", "nodes": 1, "devices_per_node": 8},
                {"name": "amd", "accelerator": "mi250x", "nodes": 1, "devices_per_node": 8},
            ],
            "cross_group_gbps": 640,
        },
        "t",
    )
    nv, amd = cluster.groups
    network = 640 / 8 / 8 * 1e9 * 0.25  # per device share of the link between the groups
    bridge = 1 / (1 / 32e9 + 1 / network + 1 / 32e9)
    assert comm.cross_group_bw(cluster, nv, amd, CAL) == pytest.approx(bridge)
    assert comm.is_bridged(nv, amd)
    same = parse_cluster(
        {
            "groups": [
                {"name": "a", "accelerator": "a100-80gb", "devices_per_node": 8},
                {"name": "b", "accelerator": "h100", "devices_per_node": 8},
            ],
            "cross_group_gbps": 640,
        },
        "t",
    )
    assert comm.cross_group_bw(same, *same.groups, CAL) == pytest.approx(network)
    assert comm.p2p_time(1e6, 1e9, CAL) == pytest.approx(1e-3 + 2e-6)


def test_stage_memory_by_hand():
    # Korthikanti et al.'s s b h (10 + 24/t) with flash attention, less the two 1-byte dropout
    # masks the runtime has no dropout for, plus what they leave out: the norms' fp32 mean and
    # 1/std (16 bytes a token) and the attention's fp32 log-sum-exp (4 a / t).
    b, s, h, a, t = 2, 512, 1024, 16, 2
    per_layer = s * b * h * (8 + 24 / t) + s * b * (16 + 4 * a / t)
    assert memory.layer_activation_bytes(GPT, t, b, BF16) == pytest.approx(per_layer)
    shape = {"layers": 2, "tp": t, "stages": 2, "micro_batches": 8, "micro_batch": b}
    shape["precision"] = BF16
    mem = memory.stage_memory(
        GPT, stage=0, recompute=Recompute.NONE, schedule=Schedule.ONE_F_ONE_B, **shape
    )
    params = (2 * parameter_counts(GPT).layer + parameter_counts(GPT).embedding) / t
    assert mem.weights_gb == pytest.approx(params * 2 / 1e9)
    assert mem.weights_gb + mem.grads_gb + mem.optimizer_gb == pytest.approx(params * 18 / 1e9)
    assert mem.state_gb == pytest.approx(params * 18 / 1e9)
    assert mem.activations_gb == pytest.approx(2 * 2 * per_layer / 1e9)  # stage 0 of 2 holds 2
    # Its two outputs kept until their backward, the gradient received for the one under way,
    # and the MLP's backward: fc2's input gradient and GELU's, (N, 4h/t) each.
    hidden, ffn = b * s * h * 2, b * s * 4 * h / t * 2
    assert mem.buffers_gb == pytest.approx((2 * hidden + hidden + 2 * ffn) / 1e9)
    # The runtime checkpoints each layer: a micro-batch in flight keeps each layer's input (the
    # first stage's first: the embedding's output), and a backward rebuilds one layer, whose
    # activations include its input, kept already.
    recomputed = memory.stage_memory(
        GPT, stage=0, recompute=Recompute.FULL, schedule=Schedule.ONE_F_ONE_B, **shape
    )
    assert recomputed.activations_gb == pytest.approx((2 * 2 * hidden + per_layer - hidden) / 1e9)
    later = memory.stage_memory(
        GPT, stage=1, recompute=Recompute.FULL, schedule=Schedule.ONE_F_ONE_B, **shape
    )
    assert later.activations_gb == pytest.approx((2 * hidden + per_layer - hidden) / 1e9)
    gpipe = memory.stage_memory(
        GPT, stage=0, recompute=Recompute.NONE, schedule=Schedule.GPIPE, **shape
    )
    assert gpipe.activations_gb == pytest.approx(8 * 2 * per_layer / 1e9)
    assert mem.total_gb == pytest.approx(mem.state_gb + mem.activations_gb + mem.buffers_gb)


def test_last_stage_prices_its_loss_at_its_highest_moment():
    """Llama's last stage, one micro-batch: the loss's backward is its peak where the vocabulary
    is wide; bf16 (or TP > 1) keeps the logits in their dtype and makes one fp32 softmax. The
    logits live as long as the loss keeps them (runtime.pipeline drops its own once the loss is
    made): not past the loss's backward."""
    b, s, h, v = 1, 512, 1024, 1000
    tokens = b * s
    for t, precision in ((1, BF16), (2, Precision.FP32)):
        element = precision.element_bytes
        logits = tokens * v / t * element
        # RMSNorm on the CPU (runtime.model.RMSNorm): its input, the fp32 rstd, and its output
        # (the head's GEMM keeps it), as the fused kernel keeps
        norm = 2 * tokens * h * element + tokens * 4
        cast = logits if element == 2 else 0
        loss = norm + logits + tokens * 4 + tokens * v / t * 4 + cast
        head = norm + logits + v / t * h * element + tokens * h * element
        # from the head's backward on, its weight's gradient (autograd's until the backward's end)
        head_grad = v / t * h * element
        final_norm = tokens * h * element + 2 * tokens * h * 4 + head_grad
        # then a layer's MLP backward: two (N, ffn/t) gradients and the layer's output's
        layer = 2 * tokens * LLAMA.ffn_hidden / t * element + tokens * h * element
        layer += head_grad
        assert memory.loss_bytes(LLAMA, t, b, precision, kernels=Kernels.CPU) == pytest.approx(
            max(loss, head, final_norm, layer)
        )
        # One fused RMSNorm kernel each way: it keeps its input, rstd and output, and its
        # backward makes the input's gradient.
        fused = tokens * h * 2 * element + tokens * 4
        assert memory.loss_bytes(LLAMA, t, b, precision) == pytest.approx(
            max(loss - norm + fused, head - norm + fused, layer)
        )
    # fp32 at TP 1: F.cross_entropy keeps the fp32 log-softmax (not the logits), and its backward
    # makes two more
    fp32 = tokens * v * 4
    norm = tokens * h * 12 + tokens * 4
    # then a layer's MLP backward, the head's weight gradient still autograd's (a step's first)
    layer = 2 * tokens * LLAMA.ffn_hidden * 4 + tokens * h * 4 + v * h * 4
    assert memory.loss_bytes(LLAMA, 1, b, Precision.FP32, kernels=Kernels.CPU) == pytest.approx(
        max(norm + 3 * fp32, norm + fp32 + v * h * 4 + tokens * h * 4, layer)
    )


def test_in_flight_micro_batches():
    assert [in_flight_micro_batches("1f1b", s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert in_flight_micro_batches("1f1b", 0, 4, 2) == 2
    assert in_flight_micro_batches("gpipe", 3, 4, 8) == 8
