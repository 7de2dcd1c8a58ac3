"""benchmarks/gpu_check.py: its CPU half runs to its summary here, and the files of its GPU half
are valid for hethub (the GPU half itself runs only on a GPU machine)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_scripts import load_benchmark

from hethub.cli import main
from hethub.spec import load_plan

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
        "  reference (plain)    hethub ",
        "  kernels (eager)      GEMM ",
        "  kernels (compiled)   GEMM ",
        "  compile              median step ",
        "  phases               gpu tests ok",
        "  targets              catalog step ",
    ):
        assert line in out, line
    for phase in ("predict (profile)", "train", "reference", "train (compiled)", "kernel split"):
        assert f"{phase} ok" in out, phase
    assert "n/a" not in out and "not measured" not in out
    for run in ("run", "run-compiled"):
        metrics = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        assert len(metrics) == 8  # --quick: 8 steps, the median of the last 3


def test_the_gpu_halfs_files_are_a_plan_hethub_predicts(tmp_path, capsys):
    check = load_benchmark("gpu_check")
    _, cluster, plan = check.write_files(tmp_path, check.GPU)
    assert main(["predict", "--cluster", str(cluster), "--plan", str(plan), "--json"]) == 0
    prediction = json.loads(capsys.readouterr().out)
    assert prediction["fits"] and prediction["stages"][0]["accelerator"] == "h200"
    assert check.sum_params(check.GPU) == pytest.approx(374e6, rel=0.01)
    assert "precision: bf16" in plan.read_text() and prediction["precision"] == "bf16"


def test_the_compiled_plan_is_the_plan_with_compile_on(tmp_path):
    check = load_benchmark("gpu_check")
    _, _, plan = check.write_files(tmp_path, check.CPU)
    eager, compiled = load_plan(plan), load_plan(tmp_path / check.COMPILED_PLAN)
    assert not eager.compile and compiled.compile
    assert dataclasses.replace(compiled, compile=False) == eager


def _event(name, cat, ts, dur, tid=1):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid}


def test_the_kernel_split_classes_kernels_and_counts_the_device_idle_between_them():
    check = load_benchmark("gpu_check")
    step = check.STEP_MARK
    trace = {
        "traceEvents": [
            _event(step, "user_annotation", 0, 100),
            _event(step, "user_annotation", 100, 100),
            _event("sm90_xmma_gemm_bf16bf16_bf16f32", "kernel", 10, 40),
            _event("flash_fwd_kernel", "kernel", 30, 20),  # overlaps the GEMM: busy once
            _event("fmha_cutlassF_bf16_aligned", "kernel", 120, 10),  # attention, not GEMM
            _event("nvjet_tst_128x256", "kernel", 130, 20),
            _event("vectorized_elementwise_kernel", "kernel", 190, 20),  # half past the window
            _event("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", 180, 5),
            _event("cudaLaunchKernel", "cuda_runtime", 0, 200),  # the host's, not a kernel
        ]
    }
    split = check.kernel_split(trace, steps=2, device=True)
    # kernel time 40 + 20 + 10 + 20 + 10 + 5 = 105: GEMM 60, attention 30, other 15
    assert split["gemm"] == pytest.approx(60 / 105)
    assert split["attention"] == pytest.approx(30 / 105)
    assert split["other"] == pytest.approx(15 / 105)
    # busy: [10, 50) [120, 150) [180, 185) [190, 200) = 85 of 200
    assert split["idle"] == pytest.approx(1 - 85 / 200)
    assert split["kernels_per_step"] == 3 and split["step_ms"] == pytest.approx(0.1)


def test_on_a_cpu_the_split_reads_the_outermost_aten_operations():
    check = load_benchmark("gpu_check")
    trace = {
        "traceEvents": [
            _event(check.STEP_MARK, "user_annotation", 0, 100),
            _event("aten::linear", "cpu_op", 0, 30),
            _event("aten::mm", "cpu_op", 5, 20),  # inside aten::linear: counted once, there
            _event("aten::_scaled_dot_product_flash_attention_for_cpu", "cpu_op", 40, 20),
            _event("aten::mm", "cpu_op", 50, 10, tid=2),  # the backward's thread
            _event("aten::add", "cpu_op", 70, 10),
        ]
    }
    split = check.kernel_split(trace, steps=1, device=False)
    assert split["kernels_per_step"] == 4
    assert split["gemm"] == pytest.approx(40 / 70) and split["other"] == pytest.approx(10 / 70)
    assert split["idle"] == pytest.approx(1 - 60 / 100)  # [0, 30) [40, 60) [70, 80)


def test_the_reference_line_is_read_from_single_device_output(tmp_path):
    check = load_benchmark("gpu_check")
    out = (
        "bf16: first loss hethub 5.54, reference 5.54\n"
        "bf16 hethub   :    12.5 ms/step,    81,920 tokens/s, 1200 ops (non-view) and 1 host "
        "reads a step\n"
        "bf16 reference:    11.0 ms/step,    93,090 tokens/s, 900 ops (non-view) and 1 host "
        "reads a step\n"
        "bf16 hethub/reference throughput: 0.880x (target >= 0.95): MISSED  [median ...]\n"
    )
    assert check.parse_reference(out) == {"hethub_ms": 12.5, "reference_ms": 11.0, "ratio": 0.88}
    assert check.parse_reference("") == {"hethub_ms": None, "reference_ms": None, "ratio": None}
    command = check.reference_command(tmp_path / "model.yaml", check.GPU, 10, cpu=False)
    assert command[1:6] == [str(check.SINGLE_DEVICE), "--precision", "bf16", "--steps", "10"]
    assert ("--model" in command) == check.reference_takes_a_model()
    assert check.ratio_verdict(0.95) == "met" and check.ratio_verdict(0.9) == "MISSED"


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
