"""A plan's precision (bf16 | fp32): priced by the predictor, searched and written by the planner,
named by the outputs."""

from __future__ import annotations

import json

import pytest
import yaml

from hethub.cli import main
from hethub.errors import HethubError
from hethub.jobs import NO_BF16_KERNELS
from hethub.predictor import predict
from hethub.predictor.memory import GB, stage_params
from hethub.predictor.stage import StagePosition
from hethub.spec import load_model, parse_cluster, parse_plan
from hethub.spec.plan import Precision

MODEL = load_model("llama-7b")
A100 = parse_cluster(
    {"groups": [{"name": "nv", "accelerator": "a100-80gb", "nodes": 1, "devices_per_node": 8}]},
    "a100.yaml",
)


def plan_of(precision: str, split=(16, 16), tp=1, micro_batch=1, micro_batches=4, group="nv"):
    return parse_plan(
        {
            "model": "llama-7b",
            "global_batch": micro_batches * micro_batch,
            "micro_batch": micro_batch,
            "precision": precision,
            "pipelines": [{"stages": [{"group": group, "tp": tp, "layers": n} for n in split]}],
        },
        "plan.yaml",
    )


@pytest.mark.parametrize(("precision", "state_bytes"), [("bf16", 18), ("fp32", 16)])
def test_state_bytes_per_parameter(precision, state_bytes):
    """bf16: 2 (bf16 weight) + 4 (fp32 main grad) + 4 (fp32 master) + 8 (Adam); fp32: 4 + 4 + 8."""
    prediction = predict(plan_of(precision), A100, MODEL)
    for s, stage in enumerate(prediction.stages):
        params = stage_params(MODEL, stage.layers, StagePosition.of(s, 2))
        memory = stage.memory
        state = memory.weights_gb + memory.grads_gb + memory.optimizer_gb
        assert state * GB / params == pytest.approx(state_bytes)
        assert memory.grads_gb * GB / params == pytest.approx(4)  # fp32 gradients in both


def test_fp32_doubles_the_activations():
    bf16, fp32 = (predict(plan_of(p), A100, MODEL).stages[0] for p in ("bf16", "fp32"))
    # The first of two stages: no logits. Every saved tensor doubles but the norms' per-token
    # statistics, fp32 in both (a few bytes a token against thousands).
    ratio = fp32.memory.activations_gb / bf16.memory.activations_gb
    assert 1.99 < ratio < 2


def test_fp32_computes_slower_by_about_the_peak_ratio():
    """A compute-bound stage (large micro-batch, one device): its time scales with the peak,
    less the memory-bound operators, which only double."""
    bf16, fp32 = (
        predict(plan_of(p, split=(32,), micro_batch=4, micro_batches=1), A100, MODEL).stages[0]
        for p in ("bf16", "fp32")
    )
    peak_ratio = 312 / 19.5  # a100-80gb: bf16 tensor / plain fp32
    ratio = (fp32.forward_s + fp32.backward_s) / (bf16.forward_s + bf16.backward_s)
    assert 0.85 * peak_ratio < ratio <= peak_ratio


def test_fp32_on_a_device_without_an_fp32_figure_is_one_clear_error(tmp_path, capsys):
    gaudi = parse_cluster(
        {"groups": [{"name": "hpu", "accelerator": "gaudi2", "devices_per_node": 8}]},
        "gaudi.yaml",
    )
    with pytest.raises(HethubError, match="'hpu'.*'gaudi2' has no fp32_tflops"):
        predict(plan_of("fp32", group="hpu"), gaudi, MODEL)
    predict(plan_of("bf16", group="hpu"), gaudi, MODEL)  # bf16 is priced as before
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(
        yaml.safe_dump(
            {"groups": [{"name": "hpu", "accelerator": "gaudi2", "devices_per_node": 8}]}
        )
    )
    args = ["predict", "--cluster", str(cluster), "--model", "llama-7b", "--global-batch", "8"]
    assert main([*args, "--micro-batch", "1", "--precision", "fp32"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "fp32_tflops" in err


def test_inline_accelerator_takes_an_optional_fp32_figure():
    def cluster(**extra):
        accelerator = {"name": "x", "vendor": "other", "bf16_tflops": 300, "memory_gb": 80}
        return parse_cluster(
            {
                "groups": [
                    {"name": "g", "accelerator": {**accelerator, **extra}, "devices_per_node": 8}
                ]
            },
            "c.yaml",
        )

    assert cluster().groups[0].accelerator.fp32_tflops is None
    assert cluster(fp32_tflops=50).groups[0].accelerator.fp32_tflops == 50
    with pytest.raises(HethubError, match=r"fp32_tflops = -1: must be a positive number"):
        cluster(fp32_tflops=-1)


def test_predict_json_and_text_name_the_precision(tmp_path, capsys):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(
        yaml.safe_dump(
            {"groups": [{"name": "nv", "accelerator": "a100-80gb", "devices_per_node": 8}]}
        )
    )
    args = [
        "predict",
        "--cluster",
        str(cluster),
        "--model",
        "llama-7b",
        "--global-batch",
        "8",
        "--micro-batch",
        "1",
    ]
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["precision"] == "bf16"
    assert main([*args, "--json", "--precision", "fp32"]) == 0
    assert json.loads(capsys.readouterr().out)["precision"] == "fp32"
    assert main([*args, "--precision", "fp32"]) == 0
    assert "fp32, micro-batch 1" in capsys.readouterr().out


def test_the_planner_searches_and_writes_the_precision_asked(tmp_path, capsys):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(
        yaml.safe_dump(
            {"groups": [{"name": "nv", "accelerator": "a100-40gb", "devices_per_node": 4}]}
        )
    )
    model = tmp_path / "small.yaml"
    model.write_text(
        "arch: llama\nhidden: 2048\nlayers: 6\nheads: 16\nkv_heads: 4\n"
        "vocab: 32000\nseq_len: 2048\n"
    )
    written = {}
    for precision in ("bf16", "fp32"):
        out = tmp_path / f"{precision}.yaml"
        argv = [
            "plan",
            "--cluster",
            str(cluster),
            "--model",
            str(model),
            "--global-batch",
            "8",
            "--out",
            str(out),
            "--json",
        ]
        if precision == "fp32":
            argv += ["--precision", "fp32"]
        assert main(argv) == 0
        planned = json.loads(capsys.readouterr().out)
        assert yaml.safe_load(out.read_text())["precision"] == precision
        assert planned["prediction"]["precision"] == precision
        written[precision] = planned["prediction"]["tokens_per_s"]
    assert written["fp32"] < written["bf16"]
    assert parse_plan(yaml.safe_load(out.read_text())).precision is Precision.FP32


def test_profiles_of_the_plans_precision_price_it():
    from hethub.predictor.profiled import missing_profiles
    from tests.test_profile import CPU2, TINY, key_of, layer_profile, profiles_of
    from tests.test_profile import plan_of as profiled_plan

    lp = layer_profile(key_of())  # measured in fp32
    profiles = profiles_of(lp)
    fp32_plan = profiled_plan([("cpu", 5), ("cpu", 3)], precision="fp32")
    bf16_plan = profiled_plan([("cpu", 5), ("cpu", 3)], precision="bf16")
    fp32 = predict(fp32_plan, CPU2, TINY, profiles=profiles).stages[0]
    assert fp32.forward_s == pytest.approx(5 * lp.layer_forward_s + lp.embed_forward_s)
    bf16 = predict(bf16_plan, CPU2, TINY, profiles=profiles).stages[0]
    assert bf16 == predict(bf16_plan, CPU2, TINY).stages[0]  # no bf16 profile: analytic
    notes = missing_profiles(bf16_plan, CPU2, TINY, profiles)
    assert any(n.startswith("no profile for cpu") and "bf16" in n for n in notes)


def test_a_groups_measured_link_overrides_the_accelerators():
    def cluster(**extra):
        group = {"name": "nv", "accelerator": "rtx4090", "devices_per_node": 8, **extra}
        return parse_cluster({"groups": [group]}, "cluster.yaml")

    plan = plan_of("bf16", split=(32,), tp=8, micro_batches=8)
    small = load_model("llama-7b")
    catalog = predict(plan, cluster(), small).iteration_time_s
    slower = predict(plan, cluster(intra_node_gb_s=10), small).iteration_time_s
    faster = predict(plan, cluster(intra_node_gb_s=100), small).iteration_time_s
    assert faster < catalog < slower
    assert cluster(intra_node_gb_s=10).groups[0].link_gb_s == 10
    assert cluster().groups[0].link_gb_s == cluster().groups[0].accelerator.intra_node_gb_s


@pytest.mark.parametrize("value", [0, -3, "fast"])
def test_a_bad_measured_link_is_one_clear_error(tmp_path, capsys, value):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(
        yaml.safe_dump(
            {
                "groups": [
                    {
                        "name": "nv",
                        "accelerator": "rtx4090",
                        "devices_per_node": 8,
                        "intra_node_gb_s": value,
                    }
                ]
            }
        )
    )
    args = ["predict", "--cluster", str(cluster), "--model", "llama-7b", "--global-batch", "8"]
    assert main([*args, "--micro-batch", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert f"groups[0].intra_node_gb_s = {value!r}: must be a positive number" in err


@pytest.mark.parametrize(("bf16_kernels", "precision"), [(True, "bf16"), (False, "fp32")])
def test_the_first_run_profiles_plans_and_trains_in_bf16_only_where_the_cpu_has_its_kernels(
    tmp_path, monkeypatch, bf16_kernels, precision
):
    # Without them (an AVX2 CPU) a bf16 matmul runs torch's reference loop, and `hethub train`
    # in bf16 profiled for 9.5 min and then stepped 6x slower than fp32 (docs/runtime.md,
    # "Precision").
    import argparse

    import hethub.cli.train
    import hethub.runtime.precision
    from hethub.jobs import prepare
    from hethub.profiler import ensure

    measured = []

    def ensure_profiles(folder, request, **kwargs):
        measured.append(request.dtype)
        folder.mkdir(parents=True, exist_ok=True)  # nothing measured: priced analytically

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hethub.runtime.precision, "cpu_has_bf16_kernels", lambda: bf16_kernels)
    monkeypatch.setattr(ensure, "ensure_profiles", ensure_profiles)
    parser = argparse.ArgumentParser()
    hethub.cli.train.add_parser(parser.add_subparsers())
    said = []
    job = prepare(parser.parse_args(["train"]), write=False, say=said.append)
    assert measured and set(measured) == {precision}
    assert job.plan.precision == Precision(precision)
    notice = [line for line in said if line.startswith("precision ")]
    assert notice == ([] if bf16_kernels else [f"precision fp32, not bf16: {NO_BF16_KERNELS}"])
