"""Bad input to `hethub predict`: exit status 2, one line on stderr naming file, field, value
and rule.

The CLI runs in-process through ``hethub.cli.main`` (fast); one test runs it as a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hethub.cli import main
from hethub.predictor import predict
from hethub.predictor.traffic import predicted_traffic
from hethub.spec import load_model, parse_cluster, parse_plan

ONE_GROUP = {
    "groups": [{"name": "nv", "accelerator": "a100-80gb", "nodes": 2, "devices_per_node": 8}]
}
TWO_GROUPS = {
    "groups": [
        {"name": "nv", "accelerator": "a100-80gb", "nodes": 2, "devices_per_node": 8},
        {"name": "amd", "accelerator": "mi250x", "nodes": 2, "devices_per_node": 8},
    ]
}


def tiny_plan(**changes) -> dict:
    """A valid plan of tiny-gpt (8 layers, 4 heads) on group nv; ``changes`` replace top-level
    fields."""
    plan = {
        "model": "tiny-gpt",
        "global_batch": 8,
        "micro_batch": 1,
        "pipelines": [
            {
                "count": 1,
                "stages": [
                    {"group": "nv", "tp": 2, "layers": 5},
                    {"group": "nv", "tp": 2, "layers": 3},
                ],
            }
        ],
    }
    plan.update(changes)
    return plan


def write(folder: Path, name: str, content) -> str:
    path = folder / name
    path.write_text(
        content if isinstance(content, str) else yaml.safe_dump(content, sort_keys=False)
    )
    return str(path)


def run_cli(capsys, args: list[str]) -> tuple[int, str, str]:
    capsys.readouterr()  # drop anything printed before
    try:
        code = main(["predict", *args])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    except Exception as exc:  # noqa: BLE001 - the CLI must never let one escape
        pytest.fail(
            f"an exception escaped hethub predict (the user would see a traceback): {exc!r}"
        )
    out, err = capsys.readouterr()
    return code, out, err


def assert_error(capsys, args: list[str], *fragments: str) -> str:
    """Exit 2, exactly one line on stderr, no traceback, and every fragment in the message."""
    code, out, err = run_cli(capsys, args)
    assert code == 2, f"exit status {code}, stderr: {err!r}"
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {lines!r}"
    message = lines[0]
    assert message.startswith("hethub predict: error: "), message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert out == ""
    return message


def plan_args(tmp_path: Path, plan: dict | str, cluster: dict | str = ONE_GROUP) -> list[str]:
    return [
        "--cluster",
        write(tmp_path, "cluster.yaml", cluster),
        "--plan",
        write(tmp_path, "plan.yaml", plan),
    ]


# --------------------------------------------------------------------------------------------
# Files: syntax, missing, unknown names


def test_yaml_syntax_error_in_cluster(tmp_path, capsys) -> None:
    args = plan_args(tmp_path, tiny_plan(), "groups:\n  - name: nv\n    nodes: [1, 2\n")
    assert_error(capsys, args, "cluster.yaml", "not valid YAML", "line")


def test_yaml_syntax_error_in_plan(tmp_path, capsys) -> None:
    args = plan_args(tmp_path, "model: tiny-gpt\nglobal_batch: 8: 9\n")
    assert_error(capsys, args, "plan.yaml", "not valid YAML", "line 2")


def test_missing_cluster_file(tmp_path, capsys) -> None:
    missing = str(tmp_path / "nope.yaml")
    assert_error(
        capsys,
        ["--cluster", missing, "--plan", write(tmp_path, "plan.yaml", tiny_plan())],
        missing,
        "cluster file not found",
    )


def test_missing_plan_file(tmp_path, capsys) -> None:
    missing = str(tmp_path / "nope-plan.yaml")
    assert_error(
        capsys,
        ["--cluster", write(tmp_path, "cluster.yaml", ONE_GROUP), "--plan", missing],
        missing,
        "plan file not found",
    )


def test_cluster_file_not_a_mapping(tmp_path, capsys) -> None:
    assert_error(
        capsys,
        plan_args(tmp_path, tiny_plan(), "- just\n- a list\n"),
        "cluster.yaml",
        "<top level>",
        "must be a mapping",
    )


def test_unknown_accelerator_with_suggestion(tmp_path, capsys) -> None:
    cluster = {
        "groups": [{"name": "nv", "accelerator": "a100-80", "nodes": 1, "devices_per_node": 8}]
    }
    assert_error(
        capsys,
        plan_args(tmp_path, tiny_plan(), cluster),
        "cluster.yaml",
        "groups[0].accelerator",
        "'a100-80'",
        "unknown accelerator",
        "did you mean 'a100-80gb'",
    )


def test_unknown_inline_vendor_with_suggestion(tmp_path, capsys) -> None:
    cluster = {
        "groups": [
            {
                "name": "nv",
                "devices_per_node": 8,
                "accelerator": {
                    "name": "x",
                    "vendor": "nvida",
                    "bf16_tflops": 100,
                    "memory_gb": 40,
                },
            }
        ]
    }
    assert_error(
        capsys,
        plan_args(tmp_path, tiny_plan(), cluster),
        "cluster.yaml",
        "groups[0].accelerator.vendor",
        "'nvida'",
        "must be one of",
        "did you mean 'nvidia'",
    )


@pytest.mark.parametrize("value", ["fp16", "fp8", "bf17"])
def test_unsupported_precision_in_plan(tmp_path, capsys, value) -> None:
    assert_error(
        capsys,
        plan_args(tmp_path, tiny_plan(precision=value)),
        "plan.yaml",
        "precision",
        f"'{value}'",
        "must be one of bf16, fp32",
    )


def test_unknown_preset_in_plan(tmp_path, capsys) -> None:
    assert_error(
        capsys,
        plan_args(tmp_path, tiny_plan(model="llama-7")),
        "plan.yaml",
        "model",
        "'llama-7'",
        "not a preset",
        "did you mean 'llama-7b'",
    )


def test_unknown_preset_in_model_flag(tmp_path, capsys) -> None:
    args = [
        "--cluster",
        write(tmp_path, "cluster.yaml", ONE_GROUP),
        "--model",
        "tiny-gtp",
        "--micro-batch",
        "1",
        "--global-batch",
        "8",
    ]
    assert_error(capsys, args, "--model", "'tiny-gtp'", "not a preset", "did you mean 'tiny-gpt'")


def test_unknown_field_in_plan_with_suggestion(tmp_path, capsys) -> None:
    plan = tiny_plan()
    plan["micro_batchs"] = plan.pop("micro_batch")
    assert_error(
        capsys,
        plan_args(tmp_path, plan),
        "plan.yaml",
        "micro_batchs",
        "unknown field",
        "did you mean 'micro_batch'",
    )


def test_unknown_field_in_plan_stage_with_suggestion(tmp_path, capsys) -> None:
    plan = tiny_plan(pipelines=[{"stages": [{"group": "nv", "tp": 1, "layer": 8}]}])
    assert_error(
        capsys,
        plan_args(tmp_path, plan),
        "plan.yaml",
        "pipelines[0].stages[0].layer",
        "unknown field",
        "did you mean 'layers'",
    )


# --------------------------------------------------------------------------------------------
# Files that mean what they say: no key twice, no infinite number, speed where it means something

CLUSTER_WITH_A_KEY_TWICE = """groups:
  - name: nv
    accelerator: a100-80gb
    devices_per_node: 8
    network_gbps: 200
    nodes: 2
    network_gbps: 400
"""


def test_a_key_given_twice_in_the_cluster_is_refused(tmp_path, capsys) -> None:
    assert_error(
        capsys,
        plan_args(tmp_path, tiny_plan(), CLUSTER_WITH_A_KEY_TWICE),
        "cluster.yaml: groups[0].network_gbps = 400: given twice in one mapping (lines 5 and 7)",
    )


def test_a_key_given_twice_in_a_plan_stage_is_refused(tmp_path, capsys) -> None:
    plan = """model: tiny-gpt
global_batch: 8
micro_batch: 1
pipelines:
  - stages:
      - {group: nv, tp: 2, layers: 5}
      - {group: nv, tp: 2, layers: 3, tp: 4}
"""
    assert_error(
        capsys,
        plan_args(tmp_path, plan),
        "plan.yaml: pipelines[0].stages[1].tp = 4: given twice in one mapping (lines 7 and 7)",
    )


def test_a_key_given_twice_in_a_model_file_is_refused(tmp_path, capsys) -> None:
    model = "arch: gpt\nhidden: 64\nlayers: 8\nheads: 4\nvocab: 256\nseq_len: 64\nlayers: 6\n"
    plan = tiny_plan(model=write(tmp_path, "mini.yaml", model))
    assert_error(
        capsys,
        plan_args(tmp_path, plan),
        "mini.yaml: layers = 6: given twice in one mapping (lines 3 and 7)",
    )


def test_yaml_merge_keys_still_override(tmp_path) -> None:
    # "<<: *base" then the mapping's own key is YAML's way to override, not a key given twice.
    from hethub.spec.fields import parse_yaml

    text = "base: &base {name: nv, nodes: 1}\ngroups:\n  - <<: *base\n    nodes: 2\n"
    assert parse_yaml(text, "c.yaml")["groups"] == [{"name": "nv", "nodes": 2}]


@pytest.mark.parametrize("value", [".inf", "-.inf", ".NaN"])
@pytest.mark.parametrize(
    ("field", "where"),
    [
        ("network_gbps", "groups[0].network_gbps"),
        ("intra_node_gb_s", "groups[0].intra_node_gb_s"),
        ("bf16_tflops", "groups[0].accelerator.bf16_tflops"),
        ("cross_group_gbps", "cross_group_gbps"),
    ],
)
def test_non_finite_cluster_numbers_are_refused(tmp_path, capsys, field, where, value) -> None:
    accelerator = "{name: x, vendor: nvidia, bf16_tflops: 300, memory_gb: 80}"
    if field == "bf16_tflops":
        accelerator = accelerator.replace("300", value)
    cluster = (
        f"groups:\n  - name: nv\n    accelerator: {accelerator}\n    nodes: 2\n"
        f"    devices_per_node: 8\n"
    )
    if field in ("network_gbps", "intra_node_gb_s"):
        cluster += f"    {field}: {value}\n"
    if field == "cross_group_gbps":
        cluster += f"cross_group_gbps: {value}\n"
    message = assert_error(
        capsys,
        plan_args(tmp_path, tiny_plan(), cluster),
        f"cluster.yaml: {where} = ",
        "must be a finite number",
    )
    assert message.split(" = ")[1].split(":")[0] in ("inf", "-inf", "nan")


@pytest.mark.parametrize(
    ("plan", "where"),
    [
        (tiny_plan(micro_batch=float("inf")), "micro_batch = inf"),
        (tiny_plan(global_batch=float("nan")), "global_batch = nan"),
    ],
)
def test_non_finite_plan_numbers_are_refused(tmp_path, capsys, plan, where) -> None:
    assert_error(capsys, plan_args(tmp_path, plan), f"plan.yaml: {where}: must be a finite number")


def test_non_finite_model_numbers_are_refused(tmp_path, capsys) -> None:
    model = "arch: gpt\nhidden: 64\nlayers: .inf\nheads: 4\nvocab: 256\nseq_len: 64\n"
    plan = tiny_plan(model=write(tmp_path, "mini.yaml", model))
    assert_error(
        capsys, plan_args(tmp_path, plan), "mini.yaml: layers = inf: must be a finite number"
    )


def cpu_group(**fields) -> dict:
    return {"groups": [{"name": "nv", "nodes": 2, "devices_per_node": 8, **fields}]}


@pytest.mark.parametrize("accelerator", ["h100", "a100-80gb"])
def test_speed_on_a_gpu_group_is_refused(tmp_path, capsys, accelerator) -> None:
    for speed in (2.0, 0.5):
        assert_error(
            capsys,
            plan_args(tmp_path, tiny_plan(), cpu_group(accelerator=accelerator, speed=speed)),
            f"cluster.yaml: groups[0].speed = {speed}: emulates a slower device on this "
            f"machine's CPU, so only a group whose accelerator is the CPU takes it "
            f"(this group's is {accelerator})",
        )


def test_speed_above_one_is_refused(tmp_path, capsys) -> None:
    assert_error(
        capsys,
        plan_args(tmp_path, tiny_plan(), cpu_group(accelerator="cpu", speed=2.0)),
        "cluster.yaml: groups[0].speed = 2.0: must be at most 1",
    )


def test_speed_of_a_cpu_group_up_to_one_is_kept() -> None:
    for speed in (0.25, 1):
        cluster = parse_cluster(cpu_group(accelerator="cpu", speed=speed), "c.yaml")
        assert cluster.groups[0].speed == speed


@pytest.mark.parametrize("which", ["--cluster", "--plan", "model"])
def test_a_directory_given_for_a_file_says_so(tmp_path, capsys, which) -> None:
    folder = tmp_path / "a-folder.yaml"
    folder.mkdir()
    args = plan_args(tmp_path, tiny_plan())
    if which == "model":
        args = plan_args(tmp_path, tiny_plan(model=str(folder)))
    else:
        args[args.index(which) + 1] = str(folder)
    message = assert_error(capsys, args, f"{folder}: is a directory")
    assert "not found" not in message


# --------------------------------------------------------------------------------------------
# Non-positive numbers


@pytest.mark.parametrize(
    ("field", "value"),
    [("nodes", 0), ("devices_per_node", 0), ("nodes", -2), ("devices_per_node", -8)],
)
def test_non_positive_cluster_numbers(tmp_path, capsys, field: str, value: int) -> None:
    cluster = {
        "groups": [{"name": "nv", "accelerator": "a100-80gb", "nodes": 2, "devices_per_node": 8}]
    }
    cluster["groups"][0][field] = value
    assert_error(
        capsys,
        plan_args(tmp_path, tiny_plan(), cluster),
        "cluster.yaml",
        f"groups[0].{field} = {value}",
        "must be a positive integer",
    )


@pytest.mark.parametrize(("field", "value"), [("tp", 0), ("layers", 0), ("tp", -1)])
def test_non_positive_stage_numbers(tmp_path, capsys, field: str, value: int) -> None:
    plan = tiny_plan()
    plan["pipelines"][0]["stages"][0][field] = value
    assert_error(
        capsys,
        plan_args(tmp_path, plan),
        "plan.yaml",
        f"pipelines[0].stages[0].{field} = {value}",
        "must be a positive integer",
    )


@pytest.mark.parametrize(
    ("field", "value"), [("micro_batch", 0), ("global_batch", 0), ("global_batch", -8)]
)
def test_non_positive_plan_numbers(tmp_path, capsys, field: str, value: int) -> None:
    assert_error(
        capsys,
        plan_args(tmp_path, tiny_plan(**{field: value})),
        "plan.yaml",
        f"{field} = {value}",
        "must be a positive integer",
    )


def test_non_positive_layers_in_model_file(tmp_path, capsys) -> None:
    write(
        tmp_path,
        "mini.yaml",
        {"arch": "gpt", "hidden": 64, "layers": 0, "heads": 4, "vocab": 256, "seq_len": 64},
    )
    assert_error(
        capsys,
        plan_args(tmp_path, tiny_plan(model="mini.yaml")),
        "mini.yaml",
        "layers = 0",
        "must be a positive integer",
    )


def test_non_integer_tp(tmp_path, capsys) -> None:
    plan = tiny_plan()
    plan["pipelines"][0]["stages"][0]["tp"] = "two"
    assert_error(
        capsys,
        plan_args(tmp_path, plan),
        "plan.yaml",
        "pipelines[0].stages[0].tp = 'two'",
        "must be a positive integer",
    )


# --------------------------------------------------------------------------------------------
# The plan against the model and the cluster


def test_layers_must_sum_to_the_model(tmp_path, capsys) -> None:
    plan = tiny_plan()
    plan["pipelines"][0]["stages"][1]["layers"] = 2  # 5 + 2 = 7, tiny-gpt has 8
    assert_error(
        capsys,
        plan_args(tmp_path, plan),
        "plan.yaml",
        "pipelines[0].stages[*].layers",
        "'5+2'",
        "must sum to the model's 8 layers",
    )


def test_explicit_micro_batches_must_sum_to_global_batch(tmp_path, capsys) -> None:
    plan = tiny_plan(global_batch=64)
    plan["pipelines"][0].update(count=2, micro_batches=16)  # 2 x 16 x 1 = 32 != 64
    assert_error(
        capsys,
        plan_args(tmp_path, plan),
        "plan.yaml",
        "global_batch = 64",
        "must equal the sum",
        "= 32",
    )


def test_omitted_micro_batches_must_divide_evenly(tmp_path, capsys) -> None:
    plan = tiny_plan(global_batch=10)
    plan["pipelines"][0]["count"] = 3  # 10 sequences over 3 replicas
    assert_error(
        capsys,
        plan_args(tmp_path, plan),
        "plan.yaml",
        "global_batch = 10",
        "must divide evenly",
        "3 replica",
    )


def test_tp_above_devices_per_node(tmp_path, capsys) -> None:
    # llama-7b has 32 heads, so tp 16 divides them: only the node rule is broken.
    plan = {
        "model": "llama-7b",
        "global_batch": 8,
        "pipelines": [{"stages": [{"group": "nv", "tp": 16, "layers": 32}]}],
    }
    assert_error(
        capsys,
        plan_args(tmp_path, plan),
        "plan.yaml",
        "pipelines[0].stages[0].tp = 16",
        "devices_per_node (8)",
        "'nv'",
    )


def test_tp_must_divide_heads(tmp_path, capsys) -> None:
    # tiny-gpt has 4 heads; tp 8 fits the node of 8 devices.
    plan = tiny_plan(pipelines=[{"stages": [{"group": "nv", "tp": 8, "layers": 8}]}])
    assert_error(
        capsys,
        plan_args(tmp_path, plan),
        "plan.yaml",
        "pipelines[0].stages[0].tp = 8",
        "must divide the model's heads (4)",
    )


def test_tp_must_divide_kv_heads(tmp_path, capsys) -> None:
    # tiny-llama has 4 heads but 2 KV heads.
    plan = tiny_plan(
        model="tiny-llama", pipelines=[{"stages": [{"group": "nv", "tp": 4, "layers": 8}]}]
    )
    assert_error(
        capsys,
        plan_args(tmp_path, plan),
        "plan.yaml",
        "pipelines[0].stages[0].tp = 4",
        "kv_heads (2)",
    )


def test_plan_names_a_group_the_cluster_lacks(tmp_path, capsys) -> None:
    plan = tiny_plan()
    plan["pipelines"][0]["stages"][1]["group"] = "amdd"
    assert_error(
        capsys,
        plan_args(tmp_path, plan, TWO_GROUPS),
        "plan.yaml",
        "pipelines[0].stages[1].group = 'amdd'",
        "no such group",
        "did you mean 'amd'",
    )


def test_plan_uses_more_devices_than_the_group_has(tmp_path, capsys) -> None:
    # 3 replicas x 8 devices = 24 of group nv, which has 2 nodes x 8 = 16.
    plan = tiny_plan(
        global_batch=24,
        pipelines=[
            {
                "count": 3,
                "stages": [
                    {"group": "nv", "tp": 4, "layers": 4},
                    {"group": "nv", "tp": 4, "layers": 4},
                ],
            }
        ],
    )
    assert_error(
        capsys,
        plan_args(tmp_path, plan),
        "plan.yaml",
        "24 devices",
        "'nv'",
        "at most the group's 16 devices",
    )


# --------------------------------------------------------------------------------------------
# Shorthand flags


def shorthand(
    tmp_path: Path, *flags: str, cluster: dict = ONE_GROUP, model: str = "tiny-gpt"
) -> list[str]:
    return ["--cluster", write(tmp_path, "cluster.yaml", cluster), "--model", model, *flags]


@pytest.mark.parametrize("flag", ["--tp", "--pp", "--dp", "--micro-batch", "--global-batch"])
def test_shorthand_zero(tmp_path, capsys, flag: str) -> None:
    values = {"--micro-batch": "1", "--global-batch": "8", flag: "0"}
    args = shorthand(tmp_path, *[x for pair in values.items() for x in pair])
    assert_error(capsys, args, f"{flag} = 0", "must be a positive integer")


def test_shorthand_global_batch_not_divisible(tmp_path, capsys) -> None:
    args = shorthand(tmp_path, "--dp", "2", "--micro-batch", "4", "--global-batch", "12")
    assert_error(
        capsys, args, "--global-batch = 12", "must be a multiple of --dp x --micro-batch", "8"
    )


def test_shorthand_on_a_two_group_cluster(tmp_path, capsys) -> None:
    args = shorthand(tmp_path, "--micro-batch", "1", "--global-batch", "8", cluster=TWO_GROUPS)
    assert_error(capsys, args, "cluster.yaml", "one group", "nv, amd")


def test_plan_together_with_shorthand(tmp_path, capsys) -> None:
    args = [*plan_args(tmp_path, tiny_plan()), "--tp", "2"]
    assert_error(capsys, args, "--tp", "--plan", "exclude each other")


def test_shorthand_tp_above_node(tmp_path, capsys) -> None:
    args = shorthand(
        tmp_path, "--tp", "16", "--micro-batch", "1", "--global-batch", "8", model="llama-7b"
    )
    assert_error(capsys, args, "command line", "tp = 16", "devices_per_node (8)")


def test_shorthand_more_stages_than_layers(tmp_path, capsys) -> None:
    args = shorthand(tmp_path, "--pp", "9", "--micro-batch", "1", "--global-batch", "8")
    assert_error(capsys, args, "--pp = 9", "8 layers")


def test_shorthand_interleaving_rules(tmp_path, capsys) -> None:
    common = ["--micro-batch", "1", "--global-batch", "8"]
    args = shorthand(tmp_path, "--pp", "4", "--virtual-stages", "3", *common)
    assert_error(capsys, args, "--pp x --virtual-stages = 4 x 3", "one chunk per layer")
    args = shorthand(tmp_path, "--virtual-stages", "2", *common)
    assert_error(capsys, args, "--virtual-stages = 2", "needs --pp 2 or more")
    args = shorthand(tmp_path, "--pp", "2", "--virtual-stages", "2", "--schedule", "gpipe", *common)
    assert_error(capsys, args, "--virtual-stages = 2", "needs --schedule interleaved-1f1b")


def test_shorthand_interleaved_sharded_plan_is_described(tmp_path, capsys) -> None:
    flags = ["--pp", "2", "--dp", "2", "--virtual-stages", "2", "--shard-optimizer"]
    args = shorthand(tmp_path, *flags, "--micro-batch", "1", "--global-batch", "8")
    code, out, err = run_cli(capsys, args)
    assert code == 0, err
    assert "interleaved-1f1b (virtual stages 2), sharded optimizer" in out
    assert "pipeline bubble" in out
    # tiny-gpt's 8 layers over 2 stages of 2 chunks: 2 + 2 layers a stage
    assert "2+2" in out


def test_trace_path_that_cannot_be_written(tmp_path, capsys) -> None:
    # --trace names a folder: an input error, not a crash.
    args = [*plan_args(tmp_path, tiny_plan()), "--trace", str(tmp_path)]
    assert_error(capsys, args, "--trace", str(tmp_path))


# --------------------------------------------------------------------------------------------
# Good input


def test_plan_that_does_not_fit_is_still_predicted(tmp_path, capsys) -> None:
    cluster = {
        "groups": [{"name": "a100", "accelerator": "a100-80gb", "nodes": 1, "devices_per_node": 8}]
    }
    args = [
        "--cluster",
        write(tmp_path, "cluster.yaml", cluster),
        "--model",
        "llama-70b",
        "--tp",
        "1",
        "--pp",
        "1",
        "--micro-batch",
        "1",
        "--global-batch",
        "4",
        "--json",
    ]
    code, out, err = run_cli(capsys, args)
    assert code == 0, err
    assert err == ""
    result = json.loads(out)
    assert result["fits"] is False
    assert result["peak_memory_gb"] > 80


def test_json_output_keys(tmp_path, capsys) -> None:
    code, out, err = run_cli(capsys, [*plan_args(tmp_path, tiny_plan(), TWO_GROUPS), "--json"])
    assert code == 0, err
    assert err == ""
    result = json.loads(out)
    for key in (
        "iteration_time_s",
        "tokens_per_s",
        "model_tflops_per_device",
        "peak_memory_gb",
        "fits",
        "stages",
    ):
        assert key in result, key
    assert result["fits"] is True
    # What the predictor computes, to the bit, and figures that hold together: 8 sequences of 64
    # tokens a step; each stage computes 8 micro-batches, its memory is the sum of its parts.
    plan, cluster = parse_plan(tiny_plan()), parse_cluster(TWO_GROUPS)
    model = load_model("tiny-gpt")
    traffic = predicted_traffic(plan, cluster, model)
    assert result == {**predict(plan, cluster, model).to_json(), **traffic}
    # two TP-2 stages of one vendor: their messages and sums move over its own links (the exact
    # figure is spec.collectives' plan of transfers, checked against the runtime's counts in
    # test_engine's assert_moved_as_planned), none over the bridge
    assert traffic["comm_bytes"]["native"] > 0 and traffic["comm_bytes"]["bridge"] == 0
    assert result["tokens_per_s"] == pytest.approx(8 * 64 / result["iteration_time_s"], rel=1e-12)
    assert len(result["stages"]) == 2
    for stage, layers in zip(result["stages"], (5, 3)):
        for key in ("group", "accelerator", "tp", "layers", "compute_s", "memory_gb"):
            assert key in stage, key
        assert (stage["group"], stage["accelerator"], stage["tp"], stage["layers"]) == (
            "nv",
            "a100-80gb",
            2,
            layers,
        )
        per_micro_batch = stage["forward_s"] + stage["backward_s"]
        assert stage["compute_s"] == pytest.approx(8 * per_micro_batch, rel=1e-12)
        assert stage["memory_gb"] == pytest.approx(
            sum(stage["memory_breakdown_gb"].values()), rel=1e-12
        )


def test_analytic_figures_say_how_far_they_may_be_from_the_hardware(tmp_path, capsys) -> None:
    code, out, err = run_cli(capsys, plan_args(tmp_path, tiny_plan(), TWO_GROUPS))
    assert code == 0 and err == "", err
    last = out.splitlines()[-1]
    assert last.startswith(
        "priced by            the analytic model, at each device's microbenchmarked efficiency"
    )
    assert "never fitted on" in last and "no GEMM benchmark" not in last
    # An L40S has no GEMM benchmark of its own (the catalog's NVIDIA default): the line says so.
    l40s = {"groups": [{"name": "nv", "accelerator": "l40s", "nodes": 2, "devices_per_node": 8}]}
    code, out, err = run_cli(capsys, plan_args(tmp_path, tiny_plan(), l40s))
    assert code == 0 and err == "", err
    assert "; l40s has no GEMM benchmark of its own" in out.splitlines()[-1]
    cpu = {"groups": [{"name": "nv", "accelerator": "cpu", "nodes": 1, "devices_per_node": 4}]}
    code, out, err = run_cli(capsys, plan_args(tmp_path, tiny_plan(), cpu))
    assert code == 0 and err == "", err
    last = out.splitlines()[-1]
    assert "not calibrated for this machine" in last and "hethub profile" in last


def test_one_device_is_not_one_devices(tmp_path, capsys) -> None:
    one = {
        "groups": [{"name": "nv", "accelerator": "a100-80gb", "nodes": 1, "devices_per_node": 1}]
    }
    args = shorthand(tmp_path, "--micro-batch", "1", "--global-batch", "8", cluster=one)
    code, out, err = run_cli(capsys, args)
    assert code == 0, err
    assert ", 1 device\n" in out.splitlines()[0] + "\n" and "1 devices" not in out


def test_plural_says_one_thing_and_many_things() -> None:
    from hethub.report.terminal import plural

    assert [plural(n, "rank") for n in (0, 1, 2, 1440)] == [
        "0 ranks",
        "1 rank",
        "2 ranks",
        "1,440 ranks",
    ]
    assert plural(1, "process", "processes") == "1 process"
    assert plural(3, "process", "processes") == "3 processes"


def test_plan_model_path_is_relative_to_the_plan(tmp_path, capsys, monkeypatch) -> None:
    folder = tmp_path / "plans"
    folder.mkdir()
    write(
        folder,
        "mini.yaml",
        {"arch": "gpt", "hidden": 64, "layers": 8, "heads": 4, "vocab": 256, "seq_len": 64},
    )
    plan = write(folder, "plan.yaml", tiny_plan(model="mini.yaml"))
    monkeypatch.chdir(tmp_path)  # not the plan's folder
    code, out, err = run_cli(
        capsys, ["--cluster", write(tmp_path, "cluster.yaml", ONE_GROUP), "--plan", plan, "--json"]
    )
    assert code == 0, err
    assert json.loads(out)["stages"][0]["layers"] == 5


# --------------------------------------------------------------------------------------------
# The real command


def test_subprocess_missing_cluster_file(tmp_path) -> None:
    missing = tmp_path / "no-cluster.yaml"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hethub",
            "predict",
            "--cluster",
            str(missing),
            "--model",
            "tiny-gpt",
            "--micro-batch",
            "1",
            "--global-batch",
            "8",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, lines
    assert str(missing) in lines[0] and "not found" in lines[0]
    assert done.stdout == ""


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_plan_out_given_a_folder_says_so(tmp_path, capsys, force) -> None:
    folder = tmp_path / "plans"
    folder.mkdir()
    cluster = write(tmp_path, "cluster.yaml", ONE_GROUP)
    capsys.readouterr()
    argv = ["plan", "--cluster", cluster, "--model", "tiny-gpt", "--global-batch", "8"]
    code = main([*argv, "--out", str(folder), *force])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    message = (
        f"hethub plan: error: --out = {str(folder)!r}: is a directory; give the path of the plan "
        f"file to write (e.g. {str(folder / 'plan.yaml')!r})"
    )
    assert err.splitlines() == [message]
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["predict", "--cluster", "c.yaml", "--model", "tiny-gpt", "--micro-batch", "1"]
        + ["--global-batch", "8", "--json"],
        ["catalog"],
    ],
)
def test_a_reader_that_leaves_early_ends_the_command_quietly(tmp_path, argv) -> None:
    # `hethub predict --json | head -c 10`, made certain: the pipe's reading end is closed before
    # hethub starts, so its first write finds no reader (as head's exit leaves it).
    write(tmp_path, "c.yaml", ONE_GROUP)
    reading, writing = os.pipe()
    os.close(reading)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "hethub", *argv],
            stdout=writing,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
            cwd=tmp_path,
        )
    finally:
        os.close(writing)
    assert done.stderr == ""  # no BrokenPipeError traceback, no "Exception ignored" at exit
    assert done.returncode == 141  # as a tool that SIGPIPE ends: 128 + 13


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            [
                "plan",
                "--cluster",
                "c.yaml",
                "--model",
                "tiny-gpt",
                "--global-batch",
                "8",
                "--top",
                "0",
            ],
            "hethub plan: error: --top = 0: must be a positive integer",
        ),
        (
            ["train", "--steps", "-3"],
            "hethub train: error: --steps = -3: must be a positive integer",
        ),
        (
            ["predict", "--cluster", "c.yaml", "--tp", "two"],
            "hethub predict: error: --tp = two: must be a positive integer",
        ),
    ],
)
def test_a_count_flag_below_one_is_one_line_in_every_command(capsys, argv, message) -> None:
    # argparse checks these flags (hethub.cli.args.positive_int) before any file is read.
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err == message + "\n"


@pytest.mark.parametrize(
    ("flag", "value", "rule"),
    [
        ("--lr", "-1", "must be a positive finite number"),
        ("--lr", "0", "must be a positive finite number"),
        ("--lr", "nan", "must be a positive finite number"),
        ("--lr", "inf", "must be a positive finite number"),
        ("--lr", "-inf", "must be a positive finite number"),
        ("--lr", "fast", "must be a positive finite number"),
        ("--timeout", "0", "must be a positive finite number"),
        ("--timeout", "-5", "must be a positive finite number"),
        ("--timeout", "nan", "must be a positive finite number"),
        ("--timeout", "1e300", "must be at most 31536000 seconds (365 days)"),
        ("--seed", "-1", "must be an integer from 0 to 4294967295"),
        ("--seed", "99999999999999999999999", "must be an integer from 0 to 4294967295"),
    ],
)
def test_a_rate_timeout_or_seed_out_of_range_is_one_line_before_any_file_is_read(
    capsys, flag, value, rule
) -> None:
    # Once a traceback from every rank (--lr -1, --seed 10**23), C++ frames (--timeout 0), or a
    # run whose loss never moved (--lr inf).
    code = main(["train", f"{flag}={value}"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err == f"hethub train: error: {flag} = {value}: {rule}\n"
