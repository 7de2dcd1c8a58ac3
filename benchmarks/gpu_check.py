"""One check of hethub on one GPU, through the real CLI, in under 8 minutes; one summary.

With a CUDA GPU (sized for one NVIDIA H200):
  (a) the GPU tests (python -m pytest -q tests/test_gpu.py), passed or not;
  (b) a Llama of 374M parameters (hidden 1024, 24 layers, 16 heads, vocabulary 32000, sequence
      1024; micro-batch 8, global batch 32) on a one-group cluster (accelerator h200, one device):
      predicted from the catalog alone (hethub predict --json), profiled on the spot (hethub
      profile --device h200 --dtype bf16) and predicted from that profile (--profiles), then trained
      for 50 steps (hethub train --json); measured = the median step of the metrics after the
      first 5; model FLOP utilisation; predicted against measured peak memory;
  (c) the plain-torch reference trainer of benchmarks/single_device.py on the same GPU, in bf16,
      and hethub's throughput against it (its own model unless it takes --model: then this one);
  (d) where the time goes: 3 steps under torch.profiler (CUDA activity), the kernels' time split
      into GEMM, attention and other, and the GPU's idle share of the steps' wall time, with the
      layers eager and compiled;
  (e) the same training with the plan's compile: true (runtime.compiled): its median step
      against (b)'s, its first step (the compilation) and its peak memory.
Without one: one line saying so, then the same flow on the CPU with a tiny Llama (the cluster's
accelerator cpu, a few steps), so that everything but the CUDA-specific calls runs; exit 0. There
the split is of the outermost aten operations' host time, and "idle" the host's time outside them
(compiled layers run inductor's C++ kernels, which the profiler does not see: idle too).

The run, its profile and its predictions are bf16 (the plan says precision: bf16).

Targets: the catalog-only step time within 15% of the measured, the profile-based within 10%,
the predicted peak memory within 10% of the measured (``peak_memory_gb`` of the metrics, the
largest over ranks of torch.cuda.max_memory_allocated; "not recorded" where the runtime does not
record it), hethub at least 0.95x the reference's throughput. Every command has a time limit, and
so has the whole check: a phase that runs out of time is reported as such, with what finished
before it. Exit status: 0 when every phase ran (a missed target included), 1 when one failed or
ran out of time.

    python benchmarks/gpu_check.py [--quick] [--work DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from hethub.spec.accelerator import catalog

BUDGET_S = 420.0  # the whole check: 7 minutes, and a stopped command's grace, inside 8
SKIPPED_STEPS = 5  # warm-up steps left out of the measured median
QUICK_REPEATS = 3  # --quick: hethub profile --repeats (its defaults: 30 a layer pass, 15 a link)
TARGETS = {"catalog": 0.15, "profile": 0.10, "memory": 0.10}
REFERENCE_RATIO = 0.95  # hethub's throughput at least this fraction of the plain reference's
REFERENCE_STEPS = {"full": 10, "quick": 1}  # single_device.py --steps (timed steps of each)
SPLIT_WARMUP, SPLIT_STEPS = 2, 3  # the kernel split: steps before (compiling), steps profiled
SPLIT_SEED = 0
# Kernel names by class, attention first: flash attention's kernels are cutlass templates too.
# On the CPU half the names are aten operations'.
KERNEL_CLASSES = (
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    (
        "gemm",
        (
            "gemm",
            "cutlass",
            "ampere_",
            "sm80_",
            "sm90_",
            "cublas",
            "nvjet",
            "aten::linear",
            "aten::matmul",
            "aten::mm",
            "aten::addmm",
            "aten::bmm",
            "aten::baddbmm",
        ),
    ),
)

DTYPE = "bf16"  # the run's precision, its profile's dtype
COMPILED_PLAN = "plan-compiled.yaml"  # beside plan.yaml: the same plan with compile: true


@dataclass(frozen=True)
class Setup:
    """What is trained, where, and for how long."""

    accelerator: str
    model: dict
    micro_batch: int
    global_batch: int
    steps: int
    limits: dict[str, float]
    """Seconds each phase may take at most (the whole check's budget caps them too)."""


GPU = Setup(
    accelerator="h200",
    model={
        "name": "gpu-check-llama",
        "arch": "llama",
        "hidden": 1024,
        "layers": 24,
        "heads": 16,
        "vocab": 32000,
        "seq_len": 1024,
    },
    micro_batch=8,
    global_batch=32,
    steps=50,
    limits={
        "tests": 150,
        "predict": 60,
        "profile": 150,
        "train": 300,
        "reference": 90,
        "split": 150,
        "train (compiled)": 240,
    },
)
# tiny-llama's layer at micro-batch 1: the compiled runs then reuse the graph that
# tests/test_compile.py compiles (inductor's cache), instead of tens of seconds of compiling.
CPU = Setup(
    accelerator="cpu",
    model={
        "name": "gpu-check-tiny-llama",
        "arch": "llama",
        "hidden": 64,
        "layers": 4,
        "heads": 4,
        "kv_heads": 2,
        "ffn_hidden": 176,
        "vocab": 256,
        "seq_len": 64,
    },
    micro_batch=1,
    global_batch=4,
    steps=10,
    limits={
        "tests": 120,
        "predict": 60,
        "profile": 120,
        "train": 180,
        "reference": 120,
        "split": 150,
        "train (compiled)": 180,
    },
)


@dataclass
class Phase:
    name: str
    status: str = "not run"  # ok | failed | timed out | not run
    seconds: float = 0.0
    detail: str = ""


@dataclass
class Check:
    deadline: float
    env: dict
    logs: Path
    phases: list[Phase] = field(default_factory=list)

    def run(self, name: str, command: list[str], limit_s: float) -> tuple[Phase, str, str]:
        """``command`` with at most ``limit_s`` seconds (and what is left of the budget); its
        whole process group is killed when it runs out of time."""
        phase = Phase(name)
        self.phases.append(phase)
        limit = min(limit_s, self.deadline - time.monotonic())
        if limit < 5:
            phase.status, phase.detail = "not run", "no time left in the check's budget"
            return phase, "", ""
        say(f"{name}: {' '.join(command[2:] if command[0] == sys.executable else command)}")
        started = time.monotonic()
        # Into files, not pipes: a worker left behind (torchrun starts its workers in sessions
        # of their own) cannot then hold a pipe open and hang the check.
        logs = self.logs / name.replace(" ", "-").replace("(", "").replace(")", "")
        with open(f"{logs}.out", "w") as out_file, open(f"{logs}.err", "w") as err_file:
            proc = subprocess.Popen(
                command,
                cwd=ROOT,
                env=self.env,
                stdout=out_file,
                stderr=err_file,
                text=True,
                start_new_session=True,  # its process group is the check's to stop
            )
            try:
                proc.wait(timeout=limit)
                phase.status = "ok" if proc.returncode == 0 else "failed"
            except subprocess.TimeoutExpired:
                _stop(proc)
                phase.status, phase.detail = "timed out", f"stopped after {limit:.0f} s"
        out, err = Path(f"{logs}.out").read_text(), Path(f"{logs}.err").read_text()
        if phase.status == "failed":
            phase.detail = f"exit {proc.returncode}: {last_line(err) or last_line(out)}"
        phase.seconds = time.monotonic() - started
        say(f"{name}: {phase.status} in {phase.seconds:.1f} s {phase.detail}".rstrip())
        return phase, out or "", err or ""


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the command's process group (torchrun passes it on to its workers and stops
    them), then SIGKILL to what is left of the group."""
    for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)  # the group this check started for the command
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def say(message: str) -> None:
    print(f"gpu_check: {message}", file=sys.stderr, flush=True)


def last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def write_files(work: Path, setup: Setup) -> tuple[Path, Path, Path]:
    """The model, the one-group cluster and the one-stage plan, as YAML (written by hand: no
    dependency beyond the standard library here)."""
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model.yaml"
    model.write_text("".join(f"{k}: {v}\n" for k, v in setup.model.items()))
    cluster = work / "cluster.yaml"
    cluster.write_text(
        f"name: gpu-check-{setup.accelerator}\n"
        "groups:\n"
        f"  - {{name: {setup.accelerator}, accelerator: {setup.accelerator}, "
        "nodes: 1, devices_per_node: 1}\n"
    )
    plan = work / "plan.yaml"
    text = (
        "model: model.yaml\n"
        f"global_batch: {setup.global_batch}\n"
        f"micro_batch: {setup.micro_batch}\n" + f"precision: {DTYPE}\n" + "pipelines:\n"
        f"  - stages:\n      - {{group: {setup.accelerator}, tp: 1, "
        f"layers: {setup.model['layers']}}}\n"
    )
    plan.write_text(text)
    (work / COMPILED_PLAN).write_text(f"compile: true\n{text}")  # (e)'s: the same, compiled
    return model, cluster, plan


def train_command(
    cluster: Path, plan: Path, steps: int, run_dir: Path, profiles: Path
) -> list[str]:
    """hethub train of ``plan`` for ``steps`` steps, its metrics in ``run_dir``."""
    return [
        *(sys.executable, "-m", "hethub", "train"),
        *("--cluster", str(cluster), "--plan", str(plan), "--steps", str(steps), "--json"),
        *("--run-dir", str(run_dir)),
        *("--profiles", str(profiles)),  # a CPU run reuses the check's profile
        *("--checkpoint-every", str(10 * steps)),  # one checkpoint, at the end
    ]


def median_step(records: list[dict]) -> tuple[float | None, list[float]]:
    """The median step of a run's records after the first SKIPPED_STEPS (after the first, where
    it stopped before), and the steps it is the median of."""
    timed = [r["iteration_time_s"] for r in records if r["step"] > SKIPPED_STEPS]
    timed = timed or [r["iteration_time_s"] for r in records[1:]]  # a stop before step 6
    return (statistics.median(timed) if timed else None), timed


def peak_memory(records: list[dict]) -> float | None:
    """The largest peak_memory_gb of a run's records; None where none is recorded."""
    recorded = [r["peak_memory_gb"] for r in records if r.get("peak_memory_gb") is not None]
    return max(recorded) if recorded else None


def parse_json(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def read_metrics(run_dir: Path, stdout: str) -> list[dict]:
    """The step records: metrics.jsonl (complete up to a stop), else train --json's lines."""
    lines = []
    path = run_dir / "metrics.jsonl"
    if path.is_file():
        lines = path.read_text().splitlines()
    if not lines:
        lines = stdout.splitlines()
    records = [parse_json(line) for line in lines if line.strip().startswith("{")]
    return [r for r in records if r and "step" in r and "iteration_time_s" in r]


def error(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def ratio_verdict(ratio: float | None) -> str:
    if ratio is None:
        return "not checked"
    return "met" if ratio >= REFERENCE_RATIO else "MISSED"


def verdict(err: float | None, target: float) -> str:
    if err is None:
        return "not checked"
    return "met" if abs(err) <= target else "MISSED"


def fmt(value: float | None, unit: str, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f} {unit}"


def pct(err: float | None) -> str:
    return "" if err is None else f" ({100 * err:+.1f}%)"


def pytest_counts(out: str) -> str:
    """The last line of pytest -q: '4 passed, 2 skipped in 3.1s'."""
    for line in reversed(out.splitlines()):
        if any(word in line for word in ("passed", "failed", "skipped", "error")):
            return line.strip(" =")
    return last_line(out)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="fewer steps and profile repeats (a test's run)"
    )
    parser.add_argument(
        "--cpu", action="store_true", help="the CPU half even where there is a GPU (the test's)"
    )
    parser.add_argument("--work", help="working folder (default: a fresh temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the working folder")
    parser.add_argument(
        "--budget", type=float, default=BUDGET_S, help=f"seconds in all (default {BUDGET_S:g})"
    )
    parser.add_argument(
        "--kernel-split",
        action="store_true",
        help="only phase (d), on --work's files (the check runs it so, in a process of its own)",
    )
    return parser.parse_args(argv)


@dataclass(frozen=True)
class Run:
    """One check's setting: its flags, the device, the files it wrote and its step count."""

    args: argparse.Namespace
    setup: Setup
    gpu: bool
    device_name: str
    work: Path
    model_file: Path
    cluster: Path
    plan: Path
    steps: int
    started: float


@dataclass
class Results:
    """What the check's phases gave: each read where its phase ran (None: it did not)."""

    tests: Phase
    catalog_prediction: dict | None = None
    profile_prediction: dict | None = None
    notes: list[str] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)
    reference: dict = field(default_factory=dict)
    compiled_records: list[dict] = field(default_factory=list)
    splits: dict = field(default_factory=dict)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.kernel_split:
        return profile_split(Path(args.work), args.cpu)
    started = time.monotonic()

    import torch  # after the flags: --help needs no torch

    gpu = torch.cuda.is_available() and not args.cpu
    if gpu:
        name = torch.cuda.get_device_name(0)
        print(f"GPU: {name} (torch {torch.__version__}, CUDA {torch.version.cuda})", flush=True)
        setup = GPU
    else:
        why = "--cpu" if args.cpu else "torch.cuda.is_available() is False"
        print(
            f"no GPU ({why}): the CPU half, the same flow with a tiny Llama on this machine's CPU",
            flush=True,
        )
        name, setup = "", CPU
    steps = max(SKIPPED_STEPS + 3, setup.steps // 2) if args.quick else setup.steps
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="hethub-gpu-check-"))
    model_file, cluster, plan = write_files(work, setup)
    run = Run(args, setup, gpu, name, work, model_file, cluster, plan, steps, started)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
    }
    (work / "logs").mkdir(exist_ok=True)
    check = Check(deadline=started + args.budget, env=env, logs=work / "logs")
    results = _run_phases(run, check)
    print("\n".join(_summary(run, check, results)), flush=True)
    if not args.keep and not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(p.status == "ok" for p in check.phases) else 1


def _run_phases(run: Run, check: Check) -> Results:
    """The check's phases, in order, each bounded by its limit: (a) the GPU tests, (b) the
    predictions, the profile and the training run, (c) the plain reference, (e) the compiled
    run, (d) where the time goes."""
    setup, limits, hethub = run.setup, run.setup.limits, [sys.executable, "-m", "hethub"]
    profiles = run.work / "profiles"
    # (a) the GPU tests (on a CPU they skip: the line still says so)
    tests, out, _ = check.run(
        "gpu tests",
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu.py"],
        limits["tests"],
    )
    tests.detail = pytest_counts(out) or tests.detail
    results = Results(tests)
    # (b) predicted from the catalog alone, profiled here, predicted from the profile, trained
    base = ["--cluster", str(run.cluster), "--plan", str(run.plan), "--json"]
    phase, out, _ = check.run("predict (catalog)", [*hethub, "predict", *base], limits["predict"])
    results.catalog_prediction = parse_json(out) if phase.status == "ok" else None
    phase, out, _ = check.run("profile", _profile_command(run, profiles), limits["profile"])
    if phase.status == "ok":
        phase, out, err = check.run(
            "predict (profile)",
            [*hethub, "predict", *base, "--profiles", str(profiles)],
            limits["predict"],
        )
        results.profile_prediction = parse_json(out) if phase.status == "ok" else None
        results.notes = [line for line in err.splitlines() if ": note: " in line]
    run_dir = run.work / "run"
    phase, out, _ = check.run(
        "train", train_command(run.cluster, run.plan, run.steps, run_dir, profiles), limits["train"]
    )
    results.records = read_metrics(run_dir, out)
    # (c) the plain reference on the same device; (e) compiled; (d) where the time goes
    steps = REFERENCE_STEPS["quick" if run.args.quick else "full"]
    _, out, _ = check.run(
        "reference",
        reference_command(run.model_file, setup, steps, not run.gpu),
        limits["reference"],
    )
    results.reference = parse_reference(out)
    compiled_dir = run.work / "run-compiled"
    compiled_plan = run.work / COMPILED_PLAN
    _, out, _ = check.run(
        "train (compiled)",
        train_command(run.cluster, compiled_plan, run.steps, compiled_dir, profiles),
        limits["train (compiled)"],
    )
    results.compiled_records = read_metrics(compiled_dir, out)
    # After the compiled run: its compilation is in inductor's cache, which this one's reads.
    _, out, _ = check.run(
        "kernel split",
        [sys.executable, str(Path(__file__).resolve()), "--kernel-split", "--work", str(run.work)]
        + ([] if run.gpu else ["--cpu"]),
        limits["split"],
    )
    results.splits = {bool(s["compile"]): s for s in map(parse_json, out.splitlines()) if s}
    return results


def _profile_command(run: Run, profiles: Path) -> list[str]:
    """hethub profile of the check's model on its device, in its dtype, at TP 1."""
    return [
        sys.executable,
        "-m",
        "hethub",
        "profile",
        "--model",
        str(run.model_file),
        "--device",
        run.setup.accelerator,
        "--dtype",
        DTYPE,
        "--tp",
        "1",
        "--micro-batch",
        str(run.setup.micro_batch),
        # the check's plan runs one rank (write_files: one device): a profile keyed for the
        # machine's every core would not price it
        "--concurrent-ranks",
        "1",
        "--out",
        str(profiles),
        "--json",
        # --quick: a test's run, which checks the flow, not the figures' precision
        *(["--repeats", str(QUICK_REPEATS)] if run.args.quick else []),
    ]


@dataclass(frozen=True)
class Figures:
    """The check's figures, read from its phases' results."""

    measured: float | None
    timed: list[float]
    measured_memory: float | None
    precisions: list[str]
    by_catalog: float | None
    by_profile: float | None
    predicted_memory: float | None
    errors: dict[str, float | None]
    peak: float
    flops: float | None
    mfu: float | None
    compiled: float | None
    compiled_timed: list[float]
    compiled_memory: float | None
    first_compiled: float | None
    speedup: float | None


def _figures(run: Run, results: Results) -> Figures:
    measured, timed = median_step(results.records)
    measured_memory = peak_memory(results.records)
    catalog_prediction, profile_prediction = results.catalog_prediction, results.profile_prediction
    by_catalog = catalog_prediction and catalog_prediction.get("iteration_time_s")
    by_profile = profile_prediction and profile_prediction.get("iteration_time_s")
    predicted_memory = catalog_prediction and catalog_prediction.get("peak_memory_gb")
    peak = catalog()[run.setup.accelerator].bf16_tflops
    devices = 1
    per_device = catalog_prediction and catalog_prediction.get("model_tflops_per_device")
    flops = per_device * 1e12 * devices * by_catalog if per_device and by_catalog else None
    compiled, compiled_timed = median_step(results.compiled_records)
    return Figures(
        measured=measured,
        timed=timed,
        measured_memory=measured_memory,
        precisions=sorted({str(r["precision"]) for r in results.records if r.get("precision")}),
        by_catalog=by_catalog,
        by_profile=by_profile,
        predicted_memory=predicted_memory,
        errors={
            "catalog": error(by_catalog, measured),
            "profile": error(by_profile, measured),
            "memory": error(predicted_memory, measured_memory),
        },
        peak=peak,
        flops=flops,
        mfu=flops / measured / (devices * peak * 1e12) if flops and measured else None,
        compiled=compiled,
        compiled_timed=compiled_timed,
        compiled_memory=peak_memory(results.compiled_records),
        first_compiled=(
            results.compiled_records[0]["iteration_time_s"] if results.compiled_records else None
        ),
        speedup=measured / compiled if measured and compiled else None,
    )


def _summary(run: Run, check: Check, results: Results) -> list[str]:
    """The summary the check prints: what ran, then each figure against its target."""
    f = _figures(run, results)
    setup, tests, notes = run.setup, results.tests, results.notes
    params = sum_params(setup)
    errors = f.errors
    return [
        "",
        "summary",
        (
            f"  device               {run.device_name if run.gpu else 'no GPU: the CPU half'} "
            f"(cluster accelerator {setup.accelerator}, 1 device)"
        ),
        f"  gpu tests            {tests.status}: {tests.detail or 'no output'}",
        (
            f"  model                {setup.model['name']}, {params / 1e6:.1f}M parameters, "
            f"micro-batch {setup.micro_batch}, global batch {setup.global_batch} x "
            f"{setup.model['seq_len']} tokens"
        ),
        (
            f"  precision            plan {DTYPE}; "
            f"profiled {DTYPE}; run recorded {', '.join(f.precisions) or 'not recorded'}"
        ),
        f"  measured step        {fmt(f.measured, 's', 4)}"
        + (
            f" (median of {len(f.timed)} steps after the first {SKIPPED_STEPS}; "
            f"{len(results.records)} of {run.steps} steps recorded)"
            if f.measured
            else " (no step recorded)"
        ),
        (
            f"  predicted (catalog)  {fmt(f.by_catalog, 's', 4)}{pct(errors['catalog'])}: "
            f"{verdict(errors['catalog'], TARGETS['catalog'])} (target within "
            f"{100 * TARGETS['catalog']:.0f}%)"
        ),
        f"  predicted (profile)  {fmt(f.by_profile, 's', 4)}{pct(errors['profile'])}: "
        f"{verdict(errors['profile'], TARGETS['profile'])} (target within "
        f"{100 * TARGETS['profile']:.0f}%)"
        + (f"; {len(notes)} note(s): {notes[0].split(': note: ', 1)[1][:120]}" if notes else ""),
        *_summary_measures(run, results, f),
        *_summary_end(run, check, results, f),
    ]


def _summary_measures(run: Run, results: Results, f: Figures) -> list[str]:
    """The summary's MFU, memory, reference, kernel and compile lines."""
    reference, splits, errors = results.reference, results.splits, f.errors
    reference_model = (
        "this check's model" if reference_takes_a_model() else "its own model (no --model)"
    )
    return [
        "  MFU                  "
        + (
            f"{100 * f.mfu:.1f}% = {f.flops / 1e12:.3g} TFLOP a step (the predictor's model "
            f"FLOPs: predict --json model_tflops_per_device x devices x iteration_time_s) / "
            f"{f.measured:.4f} s / (1 x {f.peak:g} TFLOP/s, the catalog's bf16 peak)"
            if f.mfu
            else "n/a"
        ),
        f"  peak memory          predicted {fmt(f.predicted_memory, 'GB', 2)} (catalog), measured "
        + (
            f"{f.measured_memory:.2f} GB{pct(errors['memory'])}: "
            f"{verdict(errors['memory'], TARGETS['memory'])}"
            if f.measured_memory is not None
            else "not recorded: not checked"
        )
        + f" (target within {100 * TARGETS['memory']:.0f}%)",
        "  reference (plain)    "
        + (
            f"hethub {reference['hethub_ms']:.1f} ms, plain torch {reference['reference_ms']:.1f} "
            f"ms a step: hethub/reference {reference['ratio']:.3f}x: "
            f"{ratio_verdict(reference['ratio'])} (target >= {REFERENCE_RATIO}); "
            f"benchmarks/single_device.py, {DTYPE}, {reference_model}"
            if reference["ratio"] is not None
            else "not measured"
        ),
        f"  kernels (eager)      {split_text(splits.get(False))}",
        f"  kernels (compiled)   {split_text(splits.get(True))}",
        "  compile              "
        + (
            f"median step {f.compiled:.4f} s compiled, {f.measured:.4f} s eager: compiled/eager "
            f"throughput {f.speedup:.3f}x (median of {len(f.compiled_timed)} steps after the "
            f"first {SKIPPED_STEPS}); first step (compiling) {f.first_compiled:.1f} s; peak "
            "memory "
            + (
                f"{f.compiled_memory:.2f} GB (eager {fmt(f.measured_memory, 'GB', 2)})"
                if f.compiled_memory is not None
                else "not recorded"
            )
            if f.speedup
            else "not measured"
        ),
    ]


def _summary_end(run: Run, check: Check, results: Results, f: Figures) -> list[str]:
    """The summary's phases, targets and finishing lines."""
    errors, args = f.errors, run.args
    return [
        "  phases               "
        + "; ".join(
            f"{p.name} {p.status} {p.seconds:.0f} s"
            + (f" ({p.detail})" if p.detail and p.status != "ok" else "")
            for p in check.phases
        ),
        "  targets              "
        + ", ".join(
            f"{what} {verdict(errors[key], TARGETS[key])}"
            for what, key in (
                ("catalog step", "catalog"),
                ("profile step", "profile"),
                ("peak memory", "memory"),
            )
        )
        + f", hethub/reference {ratio_verdict(results.reference['ratio'])}",
        (
            f"  finished in {time.monotonic() - run.started:.0f} s (budget {args.budget:.0f} s); "
            f"work folder {run.work if args.keep or args.work else 'removed'}"
        ),
    ]


def sum_params(setup: Setup) -> int:
    from hethub.spec.model import parse_model
    from hethub.spec.parameters import parameter_count

    return parameter_count(parse_model(dict(setup.model), "gpu check", setup.model["name"]))


# --- (c) the plain reference --------------------------------------------------------------------

SINGLE_DEVICE = ROOT / "benchmarks" / "single_device.py"
STEP_LINE = re.compile(rf"^{DTYPE} (hethub|reference)\s*:\s*([\d.]+) ms/step", re.MULTILINE)
RATIO_LINE = re.compile(rf"^{DTYPE} hethub/reference throughput: ([\d.]+)x", re.MULTILINE)


def reference_command(model_file: Path, setup: Setup, steps: int, cpu: bool) -> list[str]:
    """single_device.py's command line, in bf16 only, on this check's device; with this check's
    model and micro-batch where it takes a model (--model, --batch), else its own small Llama.
    Read from the script's text, not asked of it: its --help imports torch, seconds a call."""
    command = [sys.executable, str(SINGLE_DEVICE), "--precision", DTYPE, "--steps", str(steps)]
    if cpu:
        command += ["--device", "cpu"]
    if reference_takes_a_model():
        command += ["--model", str(model_file), "--batch", str(setup.micro_batch)]
    return command


def reference_takes_a_model() -> bool:
    return '"--model"' in SINGLE_DEVICE.read_text()


def parse_reference(out: str) -> dict[str, float | None]:
    """single_device.py's median steps (ms) of hethub and of the reference, and its throughput
    ratio hethub/reference, from its printed lines; None for what it did not print."""
    steps = {name: float(ms) for name, ms in STEP_LINE.findall(out)}
    ratio = RATIO_LINE.search(out)
    return {
        "hethub_ms": steps.get("hethub"),
        "reference_ms": steps.get("reference"),
        "ratio": float(ratio.group(1)) if ratio else None,
    }


# --- (d) where the time goes --------------------------------------------------------------------

STEP_MARK = "gpu_check step"  # the profiled steps' record_function
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # a chrome trace's device work


def kernel_class(name: str) -> str:
    """gemm, attention or other, by the kernel's (or on a CPU the aten operation's) name."""
    lowered = name.lower()
    for what, marks in KERNEL_CLASSES:
        if any(mark in lowered for mark in marks):
            return what
    return "other"


def covered(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of the (start, end) ``intervals``."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _span(event: dict) -> tuple[float, float]:
    return float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0.0))


def outermost_operations(events: list[dict]) -> list[dict]:
    """The host's aten operations that no other aten operation runs (aten::linear, not the
    aten::mm inside it): on a CPU, the work a step hands to torch, each once."""
    ops = [e for e in events if e.get("cat") == "cpu_op" and e["name"].startswith("aten::")]
    ops.sort(key=lambda e: (e.get("tid", 0), float(e["ts"]), -float(e.get("dur", 0.0))))
    outermost, end, tid = [], float("-inf"), None  # the last outermost operation's end, thread
    for event in ops:
        start, stop = _span(event)
        if event.get("tid", 0) != tid or start >= end:
            outermost.append(event)
            end, tid = stop, event.get("tid", 0)
    return outermost


def kernel_split(trace: dict, steps: int, device: bool) -> dict[str, float]:
    """From a torch.profiler chrome trace of ``steps`` steps each inside a STEP_MARK: the share
    of the kernel time in GEMM, attention and other, the share of the steps' wall time with no
    kernel running (idle), kernels a step and the mean step (ms). ``device``: the kernels are
    the device's (CUDA activity); else the host's outermost aten operations."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    marks = [
        _span(e) for e in events if e.get("cat") == "user_annotation" and e["name"] == STEP_MARK
    ]
    if not marks:
        raise ValueError(f"no {STEP_MARK!r} annotation in the trace")
    lo, hi = min(start for start, _ in marks), max(end for _, end in marks)
    if device:
        kernels = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    else:
        kernels = outermost_operations(events)
    clipped = []
    for event in kernels:
        start, end = _span(event)
        if end > lo and start < hi:
            clipped.append((kernel_class(event["name"]), max(start, lo), min(end, hi)))
    time = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    for what, start, end in clipped:
        time[what] += end - start
    total = sum(time.values()) or 1.0
    return {
        **{what: seconds / total for what, seconds in time.items()},
        "idle": 1.0 - covered([(start, end) for _, start, end in clipped]) / (hi - lo),
        "kernels_per_step": len(clipped) / steps,
        "step_ms": (hi - lo) / steps / 1e3,
    }


def profile_split(work: Path, cpu: bool) -> int:
    """(d), in a process of its own: for the plan and then the compiled plan, SPLIT_WARMUP steps
    (the compiled plan's first compiles), then SPLIT_STEPS steps under torch.profiler; one JSON
    line each of kernel_split's figures."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from hethub.corpus import open_corpus
    from hethub.runtime.engine import Engine
    from hethub.spec import load_cluster, load_model, load_plan
    from hethub.spec.topology import build_topology

    gpu = torch.cuda.is_available() and not cpu
    device = torch.device("cuda" if gpu else "cpu")
    if not gpu:
        torch.set_num_threads(1)  # as a run's worker does
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if gpu else [])]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cluster, corpus = load_cluster(work / "cluster.yaml"), open_corpus(None)
    for plan_file in ("plan.yaml", COMPILED_PLAN):
        plan = load_plan(work / plan_file)
        spec = load_model(plan.model, relative_to=work)
        topology = build_topology(plan, cluster)
        engine = Engine.for_job(plan, topology, spec, cluster, seed=SPLIT_SEED, device=device)
        batches = [
            corpus.batch(s * plan.global_batch, plan.global_batch, spec.seq_len, SPLIT_SEED)
            for s in range(SPLIT_WARMUP + SPLIT_STEPS)
        ]
        for tokens in batches[:SPLIT_WARMUP]:
            engine.step(tokens)
        with profile(activities=activities) as prof:
            for tokens in batches[SPLIT_WARMUP:]:
                with record_function(STEP_MARK):
                    engine.step(tokens)  # ends on its read of the loss: the device is done
        trace = work / f"trace-{plan_file}.json"
        prof.export_chrome_trace(str(trace))
        split = kernel_split(json.loads(trace.read_text()), SPLIT_STEPS, gpu)
        print(json.dumps({"compile": plan.compile, **split}), flush=True)
        del engine, prof
    dist.destroy_process_group()
    return 0


def split_text(split: dict | None) -> str:
    if split is None:
        return "not measured"
    return (
        f"GEMM {100 * split['gemm']:.1f}%, attention {100 * split['attention']:.1f}%, other "
        f"{100 * split['other']:.1f}% of kernel time; idle {100 * split['idle']:.1f}% of "
        f"{split['step_ms']:.1f} ms a step; {split['kernels_per_step']:,.0f} kernels a step"
    )


if __name__ == "__main__":
    sys.exit(main())
