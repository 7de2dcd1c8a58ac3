"""`hethub validate`: a prediction made from profiles before the run, against the run itself."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["predicted_iteration_s"] > 0 and report["measured_iteration_s"] > 0
    assert report["steps_measured"] == 2  # the warm-up step is left out
    assert report["run_dir"] == "runs/two-stages"  # named after the plan file
    assert report["basis"].startswith("this machine's profiles")
    assert [(s["stage"], s["layers"]) for s in report["stages"]] == [(0, 5), (1, 3)]
    for s in report["stages"]:
        assert s["measured"]["compute_s"] > 0 and s["predicted"]["compute_s"] > 0
    # The prediction rests on the profiles alone: predict on them, after the run, gives the same
    # figure.
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
    assert json.loads(again.stdout)["iteration_time_s"] == report["predicted_iteration_s"]
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
