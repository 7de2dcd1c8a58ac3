"""benchmarks/gpu_check.py: its CPU half runs to its summary here, and the files of its GPU half
are valid for hethub (the GPU half itself runs only on a GPU machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_scripts import load_benchmark

from hethub.cli import main

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


@pytest.mark.slow
def test_the_cpu_half_runs_every_phase_and_prints_the_summary(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--cpu", "--work", str(tmp_path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert out.startswith("no GPU (")
    for line in (
        "summary",
        "  gpu tests            ok: ",
        "  measured step        ",
        "  predicted (catalog)  ",
        "  predicted (profile)  ",
        "  MFU                  ",
        "  peak memory          predicted ",
        "  phases               gpu tests ok",
        "  targets              catalog step ",
    ):
        assert line in out, line
    assert "predict (profile) ok" in out and "train ok" in out and "n/a" not in out
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 8  # --quick: 8 steps, the median of the last 3


def test_the_gpu_halfs_files_are_a_plan_hethub_predicts(tmp_path, capsys):
    check = load_benchmark("gpu_check")
    _, cluster, plan = check.write_files(tmp_path, check.GPU)
    assert main(["predict", "--cluster", str(cluster), "--plan", str(plan), "--json"]) == 0
    prediction = json.loads(capsys.readouterr().out)
    assert prediction["fits"] and prediction["stages"][0]["accelerator"] == "h200"
    assert check.sum_params(check.GPU) == pytest.approx(374e6, rel=0.01)
    assert "precision: bf16" in plan.read_text() and prediction["precision"] == "bf16"


def test_step_records_peak_memory_and_precision_are_read_where_present(tmp_path):
    check = load_benchmark("gpu_check")
    (tmp_path / "metrics.jsonl").write_text(
        "\n".join(
            json.dumps({"step": s, "iteration_time_s": 0.1 * s, "peak_memory_gb": 10 + s})
            for s in range(1, 4)
        )
    )
    records = check.read_metrics(tmp_path, "")
    assert [r["peak_memory_gb"] for r in records] == [11, 12, 13]
    # Without metrics.jsonl, train --json's lines; other lines are skipped.
    lines = 'log line\n{"step": 1, "iteration_time_s": 0.5}\n{"run_dir": "x"}\n'
    assert check.read_metrics(tmp_path / "none", lines) == [{"step": 1, "iteration_time_s": 0.5}]
    assert check.verdict(check.error(1.1, 1.0), 0.15) == "met"
    assert check.verdict(check.error(1.2, 1.0), 0.15) == "MISSED"
    assert check.verdict(check.error(None, 1.0), 0.15) == "not checked"
