"""`hethub validate`: a prediction made from profiles before the run, against the run itself."""

from __future__ import annotations

import itertools
import json
import re
import statistics
import subprocess
import sys

import pytest

from hethub.cli import build_parser, main
from hethub.cli.validate import compare, describe
from hethub.jobs import prepare

CLUSTER = "groups: [{name: cpu, accelerator: cpu, nodes: 1, devices_per_node: 2}]\n"
PLAN = """model: tiny-llama
global_batch: 4
micro_batch: 1
pipelines:
  - stages: [{group: cpu, tp: 1, layers: 5}, {group: cpu, tp: 1, layers: 3}]
"""


def hethub(cwd, *args):
    return subprocess.run(
        [sys.executable, "-m", "hethub", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.slow
def test_validate_predicts_from_profiles_before_the_run_and_compares_per_stage(tmp_path):
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    (tmp_path / "two-stages.yaml").write_text(PLAN)
    done = hethub(
        tmp_path,
        "validate",
        "--cluster",
        "cluster.yaml",
        "--plan",
        "two-stages.yaml",
        "--steps",
        "3",
        "--profiles",
        "profiles",
        "--repeats",
        "3",  # what it measures, not how precisely: the profiler's default is 30
        "--json",
        "--tolerance",
        "1000",  # the verdict's exit status is checked in-process; here: it ran and compared
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["tolerance"] == 10 and report["within_tolerance"]
    assert report["steps_measured"] == 2  # the warm-up step is left out
    assert report["run_dir"] == "runs/two-stages"  # named after the plan file
    assert report["basis"].startswith("this machine's profiles")
    assert [(s["stage"], s["layers"]) for s in report["stages"]] == [(0, 5), (1, 3)]
    # The measured figures are the medians of what the workers logged, warm-up step left out.
    logged = (tmp_path / report["run_dir"] / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in logged]
    assert [r["step"] for r in records] == [1, 2, 3]
    measured = statistics.median(r["iteration_time_s"] for r in records[1:])
    assert report["measured_iteration_s"] == measured
    predicted = report["predicted_iteration_s"]
    assert report["error"] == pytest.approx((predicted - measured) / measured)
    for s in report["stages"]:
        times = [next(x for x in r["stages"] if x["stage"] == s["stage"]) for r in records[1:]]
        for k in ("compute_s", "comm_s", "idle_s"):
            assert s["measured"][k] == statistics.median(t[k] for t in times), (s["stage"], k)
    # The prediction rests on the profiles alone: predict on them, after the run, gives the same
    # figures, the iteration's and each stage's compute.
    again = hethub(
        tmp_path,
        "predict",
        "--cluster",
        "cluster.yaml",
        "--plan",
        "two-stages.yaml",
        "--profiles",
        "profiles",
        "--json",
    )
    assert again.returncode == 0, again.stderr
    predicted_again = json.loads(again.stdout)
    assert predicted_again["iteration_time_s"] == predicted
    assert [(s["stage"], s["compute_s"]) for s in predicted_again["stages"]] == [
        (s["stage"], s["predicted"]["compute_s"]) for s in report["stages"]
    ]
    trace = json.loads((tmp_path / report["run_dir"] / "trace.json").read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert {n.split(" · ")[0] for n in names} == {"predicted", "measured"}


def test_validate_refuses_a_cluster_that_does_not_run_on_this_machine(tmp_path):
    (tmp_path / "cluster.yaml").write_text(
        "groups: [{name: nv, accelerator: h100, nodes: 1, devices_per_node: 2}]\n"
    )
    (tmp_path / "plan.yaml").write_text(PLAN.replace("group: cpu", "group: nv"))
    done = hethub(tmp_path, "validate", "--cluster", "cluster.yaml", "--plan", "plan.yaml")
    assert (
        done.returncode == 2
        and "must run on its CPU" in done.stderr
        and "Traceback" not in done.stderr
    )
    assert not (tmp_path / "runs").exists()


INTERLEAVED = """model: tiny-llama
global_batch: 4
micro_batch: 1
schedule: interleaved-1f1b
pipelines:
  - count: 2
    virtual_stages: 2
    stages: [{group: cpu, tp: 1, layers: [3, 2]}, {group: cpu, tp: 1, layers: [2, 1]}]
"""


def a_prepared_run(tmp_path, plan: str):
    """A job prepared as validate prepares it (priced by the analytic model: no profiles, nothing
    measured), and the run folder its metrics go to."""
    (tmp_path / "cluster.yaml").write_text(
        CLUSTER.replace("devices_per_node: 2", "devices_per_node: 4")
    )
    (tmp_path / "plan.yaml").write_text(plan)
    args = build_parser().parse_args(
        [
            "train",
            "--cluster",
            str(tmp_path / "cluster.yaml"),
            "--plan",
            str(tmp_path / "plan.yaml"),
        ]
        + ["--run-dir", str(tmp_path / "run"), "--profiles", str(tmp_path / "no-profiles")]
    )
    return prepare(args, measure=False, local_launch=False)


def log_steps(job, iteration_times: list[float]) -> None:
    """Metrics of steps that took ``iteration_times`` (the first a warm-up), as the workers
    log them."""
    for step, iteration in enumerate(iteration_times, start=1):
        stages = [
            {"pipeline": s.pipeline, "stage": s.position, "compute_s": s.compute_s}
            | {"comm_s": 0.0, "idle_s": 0.0}
            for s in job.prediction.stages
        ]
        job.run.append_metrics({"step": step, "iteration_time_s": iteration, "stages": stages})


def stage_names(text: str) -> list[tuple[str, str, str]]:
    """(pipeline, stage, layers) of each row of the stage table in ``text`` (plain columns,
    apart by two spaces or more)."""
    lines = [re.split(r"\s{2,}", line.strip()) for line in text.splitlines()]
    start = next(i for i, cells in enumerate(lines) if cells[:2] == ["pipeline", "stage"])
    header = lines[start]
    rows = itertools.takewhile(lambda cells: cells != [""], lines[start + 2 :])
    return [tuple(row[header.index(c)] for c in ("pipeline", "stage", "layers")) for row in rows]


def test_validate_names_stages_as_predict_does(tmp_path, capsys):
    job = a_prepared_run(tmp_path, INTERLEAVED)
    predicted = job.prediction.iteration_time_s
    log_steps(job, [9 * predicted, predicted, predicted])
    validated = describe(compare(job), job.plan)
    cluster, plan = str(tmp_path / "cluster.yaml"), str(tmp_path / "plan.yaml")
    assert main(["predict", "--cluster", cluster, "--plan", plan]) == 0
    predicted_table = capsys.readouterr().out
    # The plan's first layout (2 replicas), its stages 0 and 1, their chunks of layers.
    expected = [("0 (x2)", "0", "3+2"), ("0 (x2)", "1", "2+1")]
    assert stage_names(validated) == stage_names(predicted_table) == expected


@pytest.mark.parametrize(
    ("measured_over_predicted", "held"), [(1.2, True), (0.8, True), (1.5, False), (0.6, False)]
)
def test_validate_s_verdict_is_the_tolerance_on_the_iteration(
    tmp_path, measured_over_predicted, held
):
    job = a_prepared_run(tmp_path, PLAN)
    predicted = job.prediction.iteration_time_s
    measured = measured_over_predicted * predicted
    log_steps(job, [9 * predicted, measured, measured])
    report = compare(job, 25.0)
    assert report["error"] == pytest.approx(1 / measured_over_predicted - 1)
    assert report["within_tolerance"] is held
    last = describe(report, job.plan).splitlines()[-1]
    off = f"{100 * abs(1 / measured_over_predicted - 1):.1f}% off the measured iteration"
    assert last.startswith("prediction held" if held else "prediction failed") and off in last
    assert ("within --tolerance 25%" if held else "beyond --tolerance 25%") in last


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "ten"])
def test_validate_refuses_a_tolerance_that_is_not_a_positive_percentage(capsys, value):
    assert main(["validate", "--cluster", "c.yaml", "--plan", "p.yaml", "--tolerance", value]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"hethub validate: error: --tolerance = {value}: must be a positive finite number"
    )
