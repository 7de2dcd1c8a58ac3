"""The specs: model presets and parameter counts, the accelerator catalog, cluster and plan
files."""

from __future__ import annotations

import re

import pytest
import yaml

from hethub.errors import HethubError, SpecError
from hethub.spec import (
    ClusterSpec,
    ModelSpec,
    Plan,
    catalog,
    load_model,
    lookup,
    parse_cluster,
    parse_model,
    parse_plan,
    preset_names,
)
from hethub.spec.model import llama_ffn_hidden
from hethub.spec.parameters import parameter_count, parameter_counts
from hethub.spec.plan import (
    PipelineLayout,
    Precision,
    Recompute,
    StageSpec,
    load_plan,
    uniform_layers,
)
from hethub.spec.schedules import Schedule

# --------------------------------------------------------------------------------------------
# Model presets and parameter counts


@pytest.mark.parametrize(
    ("name", "expected", "tolerance"),
    [
        ("llama-7b", 6.74e9, 0.01),
        ("llama-13b", 13.0e9, 0.01),
        ("llama-70b", 69.0e9, 0.01),
        ("llama-140b", 140e9, 0.02),
    ],
)
def test_llama_preset_parameter_counts(name: str, expected: float, tolerance: float) -> None:
    model = load_model(name)
    assert model.arch == "llama"
    assert parameter_count(model) == pytest.approx(expected, rel=tolerance)


@pytest.mark.parametrize("name", ["llama-7b", "llama-13b", "llama-70b", "llama-140b"])
def test_llama_presets_have_seq_len_4096(name: str) -> None:
    assert load_model(name).seq_len == 4096


def test_all_llama_presets_are_checked() -> None:
    llamas = {n for n in preset_names() if n.startswith("llama-")}
    assert llamas == {"llama-7b", "llama-13b", "llama-70b", "llama-140b"}
    for name in llamas:
        assert load_model(name).seq_len == 4096


def test_preset_names_are_case_insensitive() -> None:
    assert load_model("LLaMA-7B") == load_model("llama-7b")


def test_gpt_parameter_count_by_hand() -> None:
    vocab, seq, h, layers, heads = 1000, 128, 96, 3, 4
    model = parse_model(
        {
            "arch": "gpt",
            "hidden": h,
            "layers": layers,
            "heads": heads,
            "vocab": vocab,
            "seq_len": seq,
        },
        "test",
        "small-gpt",
    )
    assert model.ffn_hidden == 4 * h
    assert model.kv_heads == heads
    embeddings = vocab * h + seq * h  # tokens + learned positions (head is tied)
    per_layer = 12 * h * h + 13 * h  # qkv+out 4h^2+4h, mlp 8h^2+5h, two layernorms 4h
    final_layernorm = 2 * h
    assert parameter_counts(model).layer == per_layer
    assert parameter_count(model) == embeddings + layers * per_layer + final_layernorm
    # The same thing with the numbers in: 96000 + 12288 + 3 * (110592 + 1248) + 192
    assert parameter_count(model) == 96000 + 12288 + 3 * (110592 + 1248) + 192


def test_llama_parameter_count_by_hand_with_gqa() -> None:
    vocab, seq, h, layers, heads, kv_heads, ffn = 500, 64, 128, 2, 8, 2, 352
    model = parse_model(
        {
            "arch": "llama",
            "hidden": h,
            "layers": layers,
            "heads": heads,
            "kv_heads": kv_heads,
            "ffn_hidden": ffn,
            "vocab": vocab,
            "seq_len": seq,
        },
        "test",
        "small-llama",
    )
    head_dim = h // heads  # 16
    kv = kv_heads * head_dim  # 32: K and V are narrower than Q
    attention = h * h + h * kv + h * kv + h * h  # q, k, v, o; no biases
    mlp = 3 * h * ffn  # gate, up, down (SwiGLU)
    norms = 2 * h  # two RMSNorm weights
    per_layer = attention + mlp + norms
    embedding = vocab * h  # no learned positions (rotary)
    head = h + vocab * h  # final RMSNorm + untied output head
    assert model.kv_hidden == kv
    assert parameter_counts(model).layer == per_layer
    assert parameter_count(model) == embedding + layers * per_layer + head
    # With the numbers in: 64000 + 2 * (40960 + 135168 + 256) + 128 + 64000
    assert parameter_count(model) == 64000 + 2 * (40960 + 135168 + 256) + 128 + 64000


def test_llama_ffn_rule() -> None:
    assert llama_ffn_hidden(4096) == 11008
    model = parse_model(
        {
            "arch": "llama",
            "hidden": 4096,
            "layers": 1,
            "heads": 32,
            "vocab": 32000,
            "seq_len": 4096,
        },
        "test",
        "x",
    )
    assert model.ffn_hidden == 11008  # the default for llama
    assert model.kv_heads == 32  # kv_heads defaults to heads


def test_load_model_by_yaml_path_relative_to_a_folder(tmp_path) -> None:
    folder = tmp_path / "plans"
    (folder / "models").mkdir(parents=True)
    (folder / "models" / "mini.yaml").write_text(
        yaml.safe_dump(
            {
                "arch": "llama",
                "hidden": 64,
                "layers": 4,
                "heads": 4,
                "kv_heads": 2,
                "ffn_hidden": 176,
                "vocab": 256,
                "seq_len": 32,
            }
        )
    )
    model = load_model("models/mini.yaml", relative_to=folder)
    assert isinstance(model, ModelSpec)
    assert model.name == "mini"
    assert (model.arch, model.hidden, model.layers, model.heads, model.kv_heads) == (
        "llama",
        64,
        4,
        4,
        2,
    )
    assert (model.ffn_hidden, model.vocab, model.seq_len) == (176, 256, 32)
    # Without the folder the relative path does not exist: one clear error, not a crash.
    with pytest.raises(HethubError) as info:
        load_model("models/mini.yaml", relative_to=tmp_path)
    assert "not found" in str(info.value)


# --------------------------------------------------------------------------------------------
# The accelerator catalog

CATALOG_NAMES = [
    "v100",
    "a100-40gb",
    "a100-80gb",
    "a800",
    "h100",
    "h800",
    "h20",
    "h200",
    "l40s",
    "rtx4090",
    "rtx3090",
    "mi210",
    "mi250x",
    "mi300x",
    "ascend-910b",
    "gaudi2",
    "gaudi3",
    "cpu",
]


def test_catalog_has_exactly_the_18_names() -> None:
    assert len(CATALOG_NAMES) == 18
    assert set(catalog()) == set(CATALOG_NAMES)


@pytest.mark.parametrize("name", CATALOG_NAMES)
def test_catalog_entry_has_source_and_figures(name: str) -> None:
    acc = catalog()[name]
    assert acc.name == name
    assert acc.source.strip()
    # the figures are the vendor's datasheet's (acc.source), not this test's: that each entry
    # has one is what it can check
    assert acc.bf16_tflops > 0 and acc.memory_gb > 0 and acc.memory_bw_gb_s > 0
    assert acc.intra_node_gb_s > 0 and acc.host_link_gb_s > 0 and acc.network_gbps > 0


def test_lookup_is_case_insensitive() -> None:
    acc = lookup("A100-80GB")
    assert acc.name == "a100-80gb"
    assert acc == catalog()["a100-80gb"]
    assert acc.memory_bytes == 80 * 2**30  # the datasheet's 80 GB of HBM: 80 GiB


@pytest.mark.parametrize(("miss", "meant"), [("a100-80", "a100-80gb"), ("h10", "h100")])
def test_lookup_near_miss_suggests(miss: str, meant: str) -> None:
    with pytest.raises(SpecError) as info:
        lookup(miss)
    message = str(info.value)
    assert "did you mean" in message
    assert meant in message
    assert miss in message


# --------------------------------------------------------------------------------------------
# The cluster file


def test_inline_accelerator_gets_vendor_defaults() -> None:
    cluster = parse_cluster(
        {
            "groups": [
                {
                    "name": "acc_a",
                    "accelerator": {
                        "name": "accel-a",
                        "vendor": "other",
                        "bf16_tflops": 320,
                        "memory_gb": 64,
                    },
                    "nodes": 4,
                    "devices_per_node": 8,
                }
            ]
        },
        "cluster.yaml",
    )
    assert isinstance(cluster, ClusterSpec)
    group = cluster.group("acc_a")
    acc = group.accelerator
    assert (acc.name, acc.vendor, acc.bf16_tflops, acc.memory_gb) == (
        "accel-a",
        "other",
        320.0,
        64.0,
    )
    # Omitted figures: the "other" vendor's defaults in the catalog file.
    assert acc.memory_bw_gb_s == 1600
    assert acc.intra_node_gb_s == 100
    assert acc.host_link_gb_s == 32
    assert acc.network_gbps == 800
    assert acc.source  # says where it came from
    assert group.network_gbps == 800
    assert group.devices == 32


def test_inline_accelerator_given_fields_win_over_defaults() -> None:
    cluster = parse_cluster(
        {
            "groups": [
                {
                    "name": "amdish",
                    "accelerator": {
                        "name": "x",
                        "vendor": "amd",
                        "bf16_tflops": 100,
                        "memory_gb": 32,
                        "intra_node_gb_s": 50,
                    },
                    "devices_per_node": 4,
                }
            ]
        }
    )
    acc = cluster.groups[0].accelerator
    assert acc.intra_node_gb_s == 50
    assert acc.memory_bw_gb_s == 3277  # amd default
    assert cluster.groups[0].nodes == 1  # nodes defaults to 1


def test_network_default_comes_from_catalog() -> None:
    cluster = parse_cluster(
        {
            "groups": [
                {"name": "nv", "accelerator": "h100", "nodes": 2, "devices_per_node": 8},
                {
                    "name": "amd",
                    "accelerator": "mi250x",
                    "nodes": 2,
                    "devices_per_node": 8,
                    "network_gbps": 400,
                },
            ]
        }
    )
    assert cluster.group("nv").network_gbps == catalog()["h100"].network_gbps
    assert cluster.group("amd").network_gbps == 400


def test_cross_group_default_is_the_smaller_network() -> None:
    cluster = parse_cluster(
        {
            "groups": [
                {
                    "name": "a",
                    "accelerator": "a100-80gb",
                    "nodes": 2,
                    "devices_per_node": 8,
                    "network_gbps": 1600,
                },
                {
                    "name": "b",
                    "accelerator": "mi250x",
                    "nodes": 2,
                    "devices_per_node": 8,
                    "network_gbps": 400,
                },
            ]
        }
    )
    a, b = cluster.group("a"), cluster.group("b")
    assert cluster.cross_group_gbps is None
    assert cluster.cross_gbps(a, b) == 400
    assert cluster.cross_gbps(b, a) == 400
    explicit = parse_cluster(
        {
            "groups": [
                {
                    "name": "a",
                    "accelerator": "a100-80gb",
                    "devices_per_node": 8,
                    "network_gbps": 1600,
                },
                {"name": "b", "accelerator": "mi250x", "devices_per_node": 8, "network_gbps": 400},
            ],
            "cross_group_gbps": 200,
        }
    )
    assert explicit.cross_gbps(explicit.group("a"), explicit.group("b")) == 200


# --------------------------------------------------------------------------------------------
# The plan file


def test_plan_defaults() -> None:
    plan = parse_plan(
        {
            "model": "llama-7b",
            "global_batch": 512,
            "pipelines": [
                {
                    "stages": [
                        {"group": "nv", "tp": 4, "layers": 18},
                        {"group": "amd", "tp": 8, "layers": 14},
                    ]
                },
                {"count": 3, "stages": [{"group": "nv", "tp": 8, "layers": 32}]},
            ],
        },
        "plan.yaml",
    )
    assert plan.micro_batch == 1
    assert plan.recompute == "none"
    assert plan.schedule == "1f1b"
    assert plan.precision == Precision.BF16
    first, second = plan.pipelines
    assert first.count == 1
    assert second.count == 3
    # 512 sequences split evenly over 1 + 3 = 4 replicas of micro-batch 1
    assert first.micro_batches == 128
    assert second.micro_batches == 128
    # each stage's recomputation and each layout's schedule are the plan's, filled in
    assert first.stages == (
        StageSpec(group="nv", tp=4, layers=18, recompute=Recompute.NONE),
        StageSpec(group="amd", tp=8, layers=14, recompute=Recompute.NONE),
    )
    assert first.schedule == second.schedule == Schedule.ONE_F_ONE_B
    assert first.devices == 12


def test_a_layout_may_set_its_own_schedule_and_a_stage_its_own_recomputation(tmp_path) -> None:
    raw = {
        "model": "tiny-llama",
        "global_batch": 8,
        "recompute": "full",
        "schedule": "1f1b",
        "pipelines": [
            {"stages": [{"group": "a", "layers": 2}, {"group": "b", "layers": 2}]},
            {
                "schedule": "zbv",
                "stages": [
                    {"group": "a", "layers": [1, 1], "recompute": "none"},
                    {"group": "b", "layers": [2, 0 + 1]},
                ],
            },
        ],
    }
    plan = parse_plan(raw, "plan.yaml")
    one, v = plan.pipelines
    assert (one.schedule, v.schedule) == (Schedule.ONE_F_ONE_B, Schedule.ZBV)
    assert [s.recompute for s in v.stages] == [Recompute.NONE, Recompute.FULL]
    assert [s.recompute for s in one.stages] == [Recompute.FULL, Recompute.FULL]
    # the V: stage 0 holds the model's chunks 0 and 3, stage 1 chunks 1 and 2
    assert v.chunk_layers() == [1, 2, 1, 1]
    # the file keeps only what differs from the plan's defaults, and reads back the same plan
    out = tmp_path / "plan.yaml"
    out.write_text(plan.to_yaml())
    assert "recompute: none" in out.read_text() and "schedule: zbv" in out.read_text()
    assert load_plan(out) == plan


@pytest.mark.parametrize(
    ("schedule", "virtual_stages", "says"),
    [("zbv", 3, "runs 2 chunk(s) per stage"), ("1f1b", 2, "runs 1 chunk(s) per stage")],
)
def test_a_schedule_refuses_a_chunk_count_it_cannot_run(schedule, virtual_stages, says) -> None:
    raw = {
        "model": "tiny-llama",
        "global_batch": 2,
        "pipelines": [
            {
                "schedule": schedule,
                "virtual_stages": virtual_stages,
                "stages": [{"group": "a", "layers": [1] * virtual_stages}] * 2,
            }
        ],
    }
    with pytest.raises(SpecError, match=re.escape(says)):
        parse_plan(raw, "plan.yaml")


def test_plan_stage_tp_defaults_to_one_and_even_split_uses_micro_batch() -> None:
    plan = parse_plan(
        {
            "model": "tiny-gpt",
            "global_batch": 64,
            "micro_batch": 4,
            "pipelines": [{"count": 2, "stages": [{"group": "g", "layers": 8}]}],
        }
    )
    assert plan.pipelines[0].stages[0].tp == 1
    assert plan.pipelines[0].micro_batches == 8  # 64 / (2 replicas x 4)


def test_plan_yaml_round_trip() -> None:
    plan = Plan(
        model="llama-7b",
        global_batch=512,
        micro_batch=2,
        recompute="full",
        schedule="gpipe",
        precision="fp32",
        pipelines=(
            PipelineLayout(
                count=2,
                micro_batches=64,
                stages=(
                    StageSpec(group="nv", tp=4, layers=18),
                    StageSpec(group="amd", tp=8, layers=14),
                ),
            ),
            PipelineLayout(
                count=1, micro_batches=128, stages=(StageSpec(group="nv", tp=8, layers=32),)
            ),
        ),
    )
    text = plan.to_yaml()
    assert "precision: fp32" in text
    again = parse_plan(yaml.safe_load(text), "round-trip")
    assert again == plan
    assert again.precision is Precision.FP32
    assert plan.summary().startswith("fp32, micro-batch 2")


def test_parsed_plan_round_trips_through_yaml() -> None:
    plan = parse_plan(
        {
            "model": "tiny-llama",
            "global_batch": 24,
            "micro_batch": 2,
            "pipelines": [
                {
                    "count": 3,
                    "stages": [{"group": "a", "tp": 2, "layers": 5}, {"group": "b", "layers": 3}],
                }
            ],
        }
    )
    assert parse_plan(yaml.safe_load(plan.to_yaml())) == plan


def test_uniform_layers() -> None:
    assert uniform_layers(10, 3) == [4, 3, 3]
    assert uniform_layers(32, 4) == [8, 8, 8, 8]
    assert uniform_layers(7, 7) == [1] * 7
