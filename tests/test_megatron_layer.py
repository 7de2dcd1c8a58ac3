"""spec.layer_ops' Megatron-LM GPT layer (Kernels.MEGATRON_LM), the layer the measured A100 runs
ran: what it keeps is Korthikanti et al. 2022's eq. 2, its GEMMs are model FLOPs' count, it is
GPT's alone, and the measured rows are priced with it, not with hethub's own layer."""

from __future__ import annotations

import collections

import pytest
from benchmark_scripts import load_benchmark

from hethub.errors import HethubError
from hethub.predictor import compute, predict
from hethub.predictor.calibration import default_calibration
from hethub.predictor.pricing import AnalyticPricing
from hethub.predictor.stage import LayerShape, StagePosition, StageShape
from hethub.spec import lookup, parse_model
from hethub.spec.cluster import DeviceGroup
from hethub.spec.layer_ops import layer_ops
from hethub.spec.megatron_layer import megatron_fused_softmax
from hethub.spec.ops import Kernels, OpKind
from hethub.spec.plan import Precision, Recompute

MEGATRON = Kernels.MEGATRON_LM
BF16 = Precision.BF16


def gpt(hidden: int, heads: int, seq: int):
    return parse_model(
        {
            "arch": "gpt",
            "hidden": hidden,
            "layers": 2,
            "heads": heads,
            "vocab": 512,
            "seq_len": seq,
        },
        "",
        "gpt",
    )


def korthikanti_eq2_bytes(s: int, b: int, h: int, a: int, t: int) -> float:
    """Activation bytes of one layer, tensor parallel t, no sequence parallelism, 2-byte
    elements and 1-byte dropout masks: sbh (10 + 24/t + 5as/(ht))."""
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


@pytest.mark.parametrize(
    ("hidden", "heads", "seq", "tp", "micro_batch"),
    [(1024, 16, 1024, 1, 1), (2048, 16, 1024, 2, 4), (3072, 32, 2048, 8, 2), (256, 4, 64, 2, 4)],
)
def test_saved_bytes_are_korthikanti_eq2(hidden, heads, seq, tp, micro_batch):
    ops = layer_ops(gpt(hidden, heads, seq), tp, micro_batch, BF16, MEGATRON)
    expected = korthikanti_eq2_bytes(seq, micro_batch, hidden, heads, tp)
    assert ops.saved_bytes == pytest.approx(expected, rel=1e-12)
    # Full recomputation keeps nothing inside the layer.
    assert (
        layer_ops(gpt(hidden, heads, seq), tp, 1, BF16, MEGATRON, Recompute.FULL).saved_bytes == 0
    )
    # Selective recomputation keeps no scores: Korthikanti et al.'s sbh (10 + 24/t) (their
    # section 4.2, without sequence parallelism); the core attention's forward runs again.
    selective = layer_ops(
        gpt(hidden, heads, seq), tp, micro_batch, BF16, MEGATRON, Recompute.SELECTIVE
    )
    assert selective.saved_bytes == pytest.approx(
        korthikanti_eq2_bytes(seq, micro_batch, hidden, 0, tp), rel=1e-12
    )
    outside_core = {
        "fused_layer_norm",
        "addmm",
        "mm",
        "allreduce_",
        "bias_dropout_add",
        "bias_gelu",
    }
    core = [op for op in ops.forward if op.name not in outside_core]
    assert core[0].name == "baddbmm" and core[-1].name == "clone"
    rerun = collections.Counter(selective.backward) - collections.Counter(ops.backward)
    assert rerun == collections.Counter(core)


@pytest.mark.parametrize(
    ("batch", "heads", "seq", "fused"),
    [
        (1, 16, 1024, True),
        (1, 2, 1024, False),  # 2 attention batches: not a multiple of 4 (TP 8 of 16 heads)
        (2, 2, 1024, True),
        (1, 4, 64, False),  # up to 128 keys a warp takes 2 rows: 8 batches a block
        (2, 4, 64, True),
        (1, 16, 16, False),  # keys must be more than 16
        (1, 16, 8192, False),  # and at most 4096
        (1, 16, 1026, False),  # and a multiple of 4
    ],
)
def test_megatron_runs_its_fused_softmax_only_where_its_kernel_takes_the_shape(
    batch, heads, seq, fused
):
    assert megatron_fused_softmax(batch, heads, seq) is fused


def test_where_the_fused_softmax_is_unavailable_torch_s_fp32_softmax_is_priced_and_kept():
    model = gpt(1024, 16, 1024)
    fused, torch_softmax = (layer_ops(model, t, 1, BF16, MEGATRON) for t in (4, 8))
    assert "scaled_upper_triang_masked_softmax" in [op.name for op in fused.forward]
    names = [op.name for op in torch_softmax.forward]
    assert "scaled_upper_triang_masked_softmax" not in names and "_softmax" in names
    # Its probabilities are kept in fp32: 2 bytes a score more than eq. 2's fp16 ones.
    scores = 1 * (16 // 8) * 1024 * 1024
    eq2 = korthikanti_eq2_bytes(1024, 1, 1024, 16, 8)
    assert torch_softmax.saved_bytes == pytest.approx(eq2 + 2 * scores, rel=1e-12)

    # Between the scores GEMM and the dropout: the fused kernel reads and writes each fp16 score
    # once (4 bytes); torch's upcast, scale, mask (1 byte a score), softmax and cast move 37.
    def softmax_bytes_per_score(ops, heads_of_rank):
        names = [op.name for op in ops]
        between = ops[names.index("baddbmm") + 1 : names.index("native_dropout")]
        return sum(op.read + op.written for op in between) / (heads_of_rank * 1024 * 1024)

    assert softmax_bytes_per_score(fused.forward, 4) == 4
    assert softmax_bytes_per_score(torch_softmax.forward, 2) == 37


def test_the_scores_grow_with_heads_times_seq_squared_where_flash_attention_keeps_none():
    model, b, t = gpt(1024, 16, 1024), 2, 2
    scores = b * (16 // t) * 1024 * 1024
    megatron = layer_ops(model, t, b, BF16, MEGATRON)
    fused = layer_ops(model, t, b, BF16, Kernels.FUSED)
    # Softmax output and dropout output (2 bytes each) and the dropout mask (1 byte) per score.
    assert megatron.saved_bytes - korthikanti_eq2_bytes(1024, b, 1024, 0, t) == 5 * scores
    score_ops = [
        op for op in megatron.forward if op.kind is OpKind.MEMORY and op.read == 2 * scores
    ]
    assert [op.name for op in score_ops] == ["scaled_upper_triang_masked_softmax", "native_dropout"]
    assert fused.saved_bytes < megatron.saved_bytes - 5 * scores


def test_operations_as_megatron_launches_them():
    model = gpt(1024, 16, 1024)
    one = layer_ops(model, 1, 1, BF16, MEGATRON)
    assert len(one.forward) == 14  # q, k and v are views of the QKV output: no copies
    assert sum(op.kind is OpKind.GEMM for op in one.forward) == 6
    # Each forward GEMM has its two gradient GEMMs.
    assert sum(op.kind is OpKind.GEMM for op in one.backward) == 12
    two = layer_ops(model, 2, 1, BF16, MEGATRON)
    for ops in (two.forward, two.backward):  # row-parallel forward, column-parallel backward
        assert sum(op.kind is OpKind.COLLECTIVE for op in ops) == 2
    recomputed = layer_ops(model, 1, 1, BF16, MEGATRON, Recompute.FULL)
    assert recomputed.backward == one.forward + one.backward


def test_gemm_flops_are_model_flops_over_every_query_key_pair():
    model, b, t = gpt(2048, 16, 1024), 4, 2
    ops = layer_ops(model, t, b, BF16, MEGATRON).forward
    flops = sum(op.flops for op in ops)
    assert flops == pytest.approx(sum(f for f, _ in compute.layer_gemms(model, t, b)))
    s, h = 1024, 2048
    assert flops == pytest.approx((24 * b * s * h * h + 4 * b * s * s * h) / t)


def test_a_llama_has_no_megatron_gpt_layer():
    llama = parse_model(
        {"arch": "llama", "hidden": 256, "layers": 2, "heads": 4, "vocab": 512, "seq_len": 64},
        "",
        "llama",
    )
    with pytest.raises(HethubError, match="Megatron-LM's GPT layer"):
        layer_ops(llama, 1, 1, BF16, MEGATRON)


def test_a_pricing_told_megatron_prices_its_layer_and_its_activations():
    model, cal = gpt(1024, 16, 1024), default_calibration()
    group = DeviceGroup(
        name="a100", accelerator=lookup("a100-80gb"), nodes=1, devices_per_node=8, network_gbps=800
    )
    own = compute.layer_cost(
        LayerShape(model, 1, 2, Recompute.NONE, BF16), group.accelerator, cal, 0
    )
    told = compute.layer_cost(
        LayerShape(model, 1, 2, Recompute.NONE, BF16), group.accelerator, cal, 0, MEGATRON
    )
    assert told.forward_s > own.forward_s  # the scores are written, read, dropped out
    shape = StageShape(model, 2, 1, StagePosition.of(0, 2), 2, Recompute.NONE, BF16)
    memories = [
        AnalyticPricing(cal, kernels=kernels).memory(group, shape, in_flight=1, optimizer_shards=1)
        for kernels in (None, MEGATRON)
    ]
    per_layer = [
        layer_ops(model, 1, 2, BF16, kernels).saved_bytes for kernels in (Kernels.FUSED, MEGATRON)
    ]
    assert memories[1].activations_gb - memories[0].activations_gb == pytest.approx(
        2 * (per_layer[1] - per_layer[0]) / 1e9
    )


def test_the_measured_rows_are_priced_as_megatron_lm_ran_them():
    rows = load_benchmark("measured_rows")
    assert {data.kernels for data in rows.ALL} == {MEGATRON}
    for row in rows.load_rows(rows.ALL)[::300]:
        told = predict(row.plan, row.cluster, row.model, kernels=MEGATRON).iteration_time_s
        own = predict(row.plan, row.cluster, row.model).iteration_time_s
        assert rows.predict_row(row).iteration_time_s == told != own
