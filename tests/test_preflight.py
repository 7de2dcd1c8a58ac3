"""Before any process starts: the folders a job writes, a run folder that holds another run, and
the pre-flight check of a local launch (memory and processes against this machine's), with
--force turning a refusal into a warning.

Every command runs in-process (hethub.cli.main) with the launch replaced by a failure: a test
that reached it would have started torchrun. Nothing here trains or profiles.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
import yaml

import hethub.cli.train
import hethub.cli.validate
import hethub.runtime.precision
from hethub.cli import main
from hethub.errors import HethubError
from hethub.jobs import preflight, prepare
from hethub.profiler.conditions import available_cores
from hethub.profiles.machine import default_profiles_dir

CPU = {"groups": [{"name": "cpu", "accelerator": "cpu", "nodes": 1, "devices_per_node": 2}]}
A100 = {"groups": [{"name": "nv", "accelerator": "a100-40gb", "nodes": 1, "devices_per_node": 2}]}


def two_stages(model: str, group: str, layers: int) -> dict:
    return {
        "model": model,
        "global_batch": 2,
        "micro_batch": 1,
        "pipelines": [
            {"stages": [{"group": group, "tp": 1, "layers": layers // 2}] * 2},
        ],
    }


TINY = two_stages("tiny-llama", "cpu", 8)
# 141B parameters on two CPU ranks: terabytes, whatever this machine has.
HUGE_ON_CPU = two_stages("llama-140b", "cpu", 96)
# llama-7b, 16 layers a stage: ~78 GB a device, the a100-40gb has 40.
OVER_ON_A100 = two_stages("llama-7b", "nv", 32)


def too_many_processes() -> tuple[dict, dict]:
    """A cluster and a plan of one more process than RANKS_PER_CORE for each of this machine's
    cores: one-stage replicas of tiny-llama, one device each."""
    n = preflight.RANKS_PER_CORE * available_cores() + 1
    cluster = {"groups": [{"name": "cpu", "accelerator": "cpu", "devices_per_node": n}]}
    plan = {
        "model": "tiny-llama",
        "global_batch": n,
        "micro_batch": 1,
        "pipelines": [{"count": n, "stages": [{"group": "cpu", "tp": 1, "layers": 8}]}],
    }
    return cluster, plan


@pytest.fixture
def here(tmp_path, monkeypatch):
    """Run in tmp_path, and fail a test whose command would start a process."""

    def no_launch(*args, **kwargs):
        pytest.fail("a process was started (torchrun)")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hethub.cli.train, "launch", no_launch)
    monkeypatch.setattr(hethub.cli.validate, "launch", no_launch)
    return tmp_path


def write(name: str, content: dict) -> str:
    Path(name).write_text(yaml.safe_dump(content, sort_keys=False))
    return name


def refused(capsys, *argv: str) -> str:
    """Exit 2, one line on stderr, no traceback, nothing written under runs/; the line."""
    capsys.readouterr()
    code = main(["train", *argv])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert "Traceback" not in err and out == ""
    lines = err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("hethub train: error: ")
    assert not Path("runs").exists()
    return lines[0]


# --- folders ------------------------------------------------------------------------------------


def test_a_run_dir_that_is_a_file_is_refused(here, capsys):
    Path("notes.txt").write_text("mine\n")
    line = refused(capsys, "--run-dir", "notes.txt")
    assert line == (
        "hethub train: error: --run-dir = 'notes.txt': is a file; give a folder (an existing "
        "one, or a new one)"
    )
    assert Path("notes.txt").read_text() == "mine\n"


def test_a_run_dir_under_a_file_is_refused(here, capsys):
    Path("notes.txt").write_text("mine\n")
    line = refused(capsys, "--run-dir", "notes.txt/run")
    assert "--run-dir = 'notes.txt/run': cannot be made" in line
    assert f"{here / 'notes.txt'} is a file" in line


def test_a_profiles_folder_that_is_a_file_is_refused_before_profiling(here, capsys):
    Path("profiles").write_text("")
    line = refused(capsys, "--profiles", "profiles")
    assert "--profiles = 'profiles': is a file" in line


# --- a folder that holds a run ------------------------------------------------------------------


def a_run(folder: str, *, checkpoint: int | None, steps: int = 4) -> Path:
    """A run's folder as hethub train leaves it, with a complete checkpoint of that step."""
    run = Path(folder)
    run.mkdir()
    (run / "cluster.yaml").write_text(yaml.safe_dump(A100))
    (run / "plan.yaml").write_text(yaml.safe_dump(two_stages("tiny-llama", "nv", 8)))
    settings = {"seed": 0, "lr": 1e-3, "data": None, "steps": steps, "checkpoint_every": 2}
    (run / "run.json").write_text(json.dumps({**settings, "timeout_s": 60}))
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.5}\n')
    if checkpoint is not None:
        saved = run / "checkpoints" / f"step-{checkpoint:06d}"
        saved.mkdir(parents=True)
        (saved / "meta.json").write_text(json.dumps({"step": checkpoint}))
    return run


@pytest.mark.parametrize(
    "checkpoint, says",
    [
        (
            None,
            (
                "holds a run that stopped before its first checkpoint; start it again from step 0 "
                "with --resume old, or give another --run-dir"
            ),
        ),
        (2, "holds a run stopped at step 2 of 4; continue it with --resume old, or give another"),
        (4, "holds a finished run (4 steps); train it further with --resume old --steps N (N "),
    ],
)
def test_a_run_dir_holding_a_run_says_how_to_go_on(here, capsys, checkpoint, says):
    a_run("old", checkpoint=checkpoint)
    cluster, plan = write("c.yaml", A100), write("p.yaml", two_stages("tiny-llama", "nv", 8))
    line = refused(capsys, "--cluster", cluster, "--plan", plan, "--run-dir", "old")
    assert f"--run-dir = 'old': {says}" in line


def resume_args(**given) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    hethub.cli.train.add_parser(parser.add_subparsers())
    args = parser.parse_args(["train", "--profiles", "none-here"])
    return argparse.Namespace(**{**vars(args), **given})


def test_resume_starts_a_run_without_a_checkpoint_again_from_step_0(here, capsys):
    run = a_run("failed", checkpoint=None)
    said = []
    job = prepare(resume_args(resume="failed", lr=2e-3), measure=False, say=said.append)
    assert job.resume_from is None  # the workers start from step 0, not from a checkpoint
    assert said == [
        "no complete checkpoint in failed/checkpoints: the run starts again from step 0"
    ]
    # nothing trained to continue exactly: the flags given replace the run's settings
    assert json.loads((run / "run.json").read_text())["lr"] == 2e-3
    assert (run / "metrics.jsonl").read_text() == ""  # the stopped attempt's steps are gone


def test_resume_without_a_checkpoint_nor_a_plan_gives_the_command_that_removes_it(here, capsys):
    (a_run("failed", checkpoint=None) / "plan.yaml").unlink()
    code = main(["train", "--resume", "failed"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1
    assert "no complete checkpoint in failed/checkpoints, and no plan.yaml" in err
    assert err.rstrip().endswith("remove the folder: rm -r failed")


# --- the pre-flight check -----------------------------------------------------------------------


def test_a_plan_whose_cpu_ranks_exceed_this_machines_memory_is_refused_before_profiling(
    here, capsys
):
    cluster, plan = write("c.yaml", CPU), write("p.yaml", HUGE_ON_CPU)
    profiles_before = set(default_profiles_dir().glob("*"))  # the session's cache is shared
    line = refused(capsys, "--cluster", cluster, "--plan", plan)
    assert "this machine cannot run the job: its 2 CPU ranks need " in line
    # MemAvailable moves from one reading to the next: the form, not the figure
    assert re.search(r"this machine has [\d,.]+ GB available \(MemAvailable\)", line), line
    assert line.endswith("(--force launches it anyway)")
    assert not Path("runs").exists()  # no run folder made
    assert set(default_profiles_dir().glob("*")) == profiles_before  # no profiles measured


@pytest.mark.parametrize(
    ("bf16_kernels", "precision", "state_bytes"), [(True, "bf16", 18), (False, "fp32", 16)]
)
def test_a_model_too_big_for_this_machine_is_refused_before_planning(
    here, capsys, monkeypatch, bf16_kernels, precision, state_bytes
):
    # in the precision the plan would have: fp32 on a CPU without bf16 kernels
    monkeypatch.setattr(hethub.runtime.precision, "cpu_has_bf16_kernels", lambda: bf16_kernels)
    line = refused(capsys, "--model", "llama-140b")
    assert f"training llama-140b in {precision} needs at least" in line
    assert f"parameters x {state_bytes} bytes of weights, gradients and optimizer states" in line


def test_a_stage_over_its_devices_memory_is_refused(here, capsys):
    cluster, plan = write("c.yaml", A100), write("p.yaml", OVER_ON_A100)
    line = refused(capsys, "--cluster", cluster, "--plan", plan)
    assert "stage 0.0 (group nv) needs " in line and "its a100-40gb has 40.3 GB usable" in line


def test_a_plan_of_more_processes_than_the_cores_can_take_is_refused(here, capsys):
    cluster, plan = too_many_processes()
    line = refused(capsys, "--cluster", write("c.yaml", cluster), "--plan", write("p.yaml", plan))
    cores = available_cores()
    assert (
        f"the plan starts {4 * cores + 1} processes on this machine, more than {4 * cores} "
        f"(4 for each of its {cores} core" in line
    )


def test_a_plan_that_fits_passes_without_a_word(here, capsys):
    given = {"cluster": write("c.yaml", CPU), "plan": write("p.yaml", TINY)}
    said = []
    job = prepare(resume_args(**given), measure=False, write=False, say=said.append)
    assert job.plan.model == "tiny-llama" and said == []
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("case", ["processes", "memory"])
def test_force_turns_the_refusal_into_one_warning(here, capsys, case):
    cluster, plan = too_many_processes() if case == "processes" else (A100, OVER_ON_A100)
    given = {"cluster": write("c.yaml", cluster), "plan": write("p.yaml", plan)}
    with pytest.raises(HethubError, match="this machine cannot run the job"):
        prepare(resume_args(**given), measure=False, write=False)
    said = []
    job = prepare(resume_args(**given, force=True), measure=False, write=False, say=said.append)
    assert job.plan.model == plan["model"]
    assert len(said) == 1 and said[0].startswith("warning: launching anyway (--force), although ")
    assert ("processes on this machine" in said[0]) == (case == "processes")
    assert ("its a100-40gb has 40.3 GB usable" in said[0]) == (case == "memory")


def test_under_torchrun_there_is_no_pre_flight(here):
    cluster, plan = too_many_processes()
    given = {"cluster": write("c.yaml", cluster), "plan": write("p.yaml", plan)}
    job = prepare(resume_args(**given), measure=False, write=False, local_launch=False)
    assert job.plan.model == "tiny-llama"
