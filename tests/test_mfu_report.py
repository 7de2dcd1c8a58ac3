"""MFU beside model TFLOP/s (issue 36 item 4): the prediction's model FLOP/s a device over the
dense peak of the plan's devices in its precision, their device-weighted mean on a mixed cluster,
in predict(), --json and the lines `hethub predict` and `hethub plan` print."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from hethub.cli import main
from hethub.predictor import predict
from hethub.spec import load_model, parse_cluster, parse_plan

TINY = load_model("tiny-gpt")
CLUSTER = {
    "groups": [
        {"name": "nv", "accelerator": "a100-80gb", "nodes": 2, "devices_per_node": 8},
        {"name": "amd", "accelerator": "mi250x", "nodes": 2, "devices_per_node": 8},
    ]
}


def one_kind_plan(precision: str = "bf16") -> dict:
    """tiny-gpt (8 layers) on group nv only: 2 replicas of 2 stages at TP 2."""
    return {
        "model": "tiny-gpt",
        "global_batch": 8,
        "micro_batch": 1,
        "precision": precision,
        "pipelines": [
            {
                "count": 2,
                "stages": [
                    {"group": "nv", "tp": 2, "layers": 4},
                    {"group": "nv", "tp": 2, "layers": 4},
                ],
            }
        ],
    }


def two_kind_plan() -> dict:
    """7 nv devices and 3 amd ones: 3 replicas of (nv at TP 2, amd at TP 1) and one nv alone, so
    the device-weighted mean differs from the mean over stages and from the mean over kinds."""
    return {
        "model": "tiny-gpt",
        "global_batch": 8,
        "micro_batch": 1,
        "pipelines": [
            {
                "count": 3,
                "micro_batches": 2,
                "stages": [
                    {"group": "nv", "tp": 2, "layers": 4},
                    {"group": "amd", "tp": 1, "layers": 4},
                ],
            },
            {"count": 1, "micro_batches": 2, "stages": [{"group": "nv", "tp": 1, "layers": 8}]},
        ],
    }


def test_one_kind_mfu_is_model_tflops_over_the_devices_peak():
    cluster = parse_cluster(CLUSTER, "test")
    peak = cluster.group("nv").accelerator.bf16_tflops
    result = predict(parse_plan(one_kind_plan()), cluster, TINY)
    assert result.mean_peak_tflops == pytest.approx(peak, rel=1e-12)
    assert result.mfu == pytest.approx(result.model_tflops_per_device / peak, rel=1e-12)
    assert 0 < result.mfu < 1


def test_an_fp32_plan_divides_by_the_fp32_peak():
    cluster = parse_cluster(CLUSTER, "test")
    accelerator = cluster.group("nv").accelerator
    assert accelerator.fp32_tflops != accelerator.bf16_tflops  # else the test proves nothing
    result = predict(parse_plan(one_kind_plan("fp32")), cluster, TINY)
    assert result.mean_peak_tflops == pytest.approx(accelerator.fp32_tflops, rel=1e-12)
    assert result.mfu == pytest.approx(
        result.model_tflops_per_device / accelerator.fp32_tflops, rel=1e-12
    )


def test_two_kinds_divide_by_the_device_weighted_mean_peak():
    cluster = parse_cluster(CLUSTER, "test")
    nv = cluster.group("nv").accelerator.bf16_tflops
    amd = cluster.group("amd").accelerator.bf16_tflops
    assert nv != amd
    result = predict(parse_plan(two_kind_plan()), cluster, TINY)
    assert result.devices == 10
    weighted = (7 * nv + 3 * amd) / 10
    assert result.mean_peak_tflops == pytest.approx(weighted, rel=1e-12)
    for wrong in ((nv + amd) / 2, (2 * nv + amd) / 3):  # per kind, per stage
        assert result.mean_peak_tflops != pytest.approx(wrong, rel=1e-6)
    assert result.mfu == pytest.approx(result.model_tflops_per_device / weighted, rel=1e-12)
    assert result.to_json()["mfu"] == result.mfu
    assert result.to_json()["mean_peak_tflops"] == result.mean_peak_tflops


def write(folder: Path, name: str, content: dict) -> str:
    path = folder / name
    path.write_text(yaml.safe_dump(content, sort_keys=False))
    return str(path)


def tflops_line(out: str) -> str:
    (line,) = [line for line in out.splitlines() if line.startswith("model TFLOP/s/device")]
    return line


def test_predict_prints_mfu_beside_model_tflops(tmp_path, capsys):
    args = [
        "predict",
        "--cluster",
        write(tmp_path, "cluster.yaml", CLUSTER),
        "--plan",
        write(tmp_path, "plan.yaml", two_kind_plan()),
    ]
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    line = tflops_line(capsys.readouterr().out)
    assert line == (
        f"model TFLOP/s/device {result['model_tflops_per_device']:.1f} "
        f"(MFU {100 * result['mfu']:.1f}% of the plan's mean bf16 peak "
        f"{result['mean_peak_tflops']:.4g})"
    )


def test_plan_prints_mfu_and_its_json_has_it(tmp_path, capsys):
    cluster = write(tmp_path, "cluster.yaml", CLUSTER)
    written = str(tmp_path / "a.yaml")
    argv = ["plan", "--cluster", cluster, "--model", "tiny-gpt", "--global-batch", "8"]
    assert main([*argv, "--out", written]) == 0
    line = tflops_line(capsys.readouterr().out)
    match = re.fullmatch(
        r"model TFLOP/s/device [\d.]+ \(MFU ([\d.]+)% of the plan's mean bf16 peak [\d.]+\)", line
    )
    assert match, line
    # The plan it wrote, priced again (one search is enough: predicting it is the same figure).
    assert main(["predict", "--cluster", cluster, "--plan", written, "--json"]) == 0
    prediction = json.loads(capsys.readouterr().out)
    assert prediction["mfu"] == pytest.approx(
        prediction["model_tflops_per_device"] / prediction["mean_peak_tflops"], rel=1e-12
    )
    assert float(match.group(1)) == pytest.approx(100 * prediction["mfu"], abs=0.05)
