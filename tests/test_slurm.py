"""`hethub launch slurm`'s heterogeneous job on a real Slurm: scripts/slurm-local.sh starts munged,
one slurmctld and two one-CPU nodes, n0 and n1, on this machine. The job's two components
(local-hetero's groups as two kinds of node) run one on each node and train with the losses of
a single-node run of the same plan; a job cancelled with `scancel --signal=TERM` after its first
checkpoint, then submitted again as it is, resumes and ends with those losses bit for bit.

Needs root and Debian's slurm-wlm and munge, which .ci/run installs."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hethub.cli import main
from hethub.runtime.spawn import rendezvous_store
from tests.test_launch import LOCAL_PLAN
from tests.test_nodes import TIMEOUT_S, environment

SLURM_LOCAL = Path(__file__).resolve().parents[1] / "scripts" / "slurm-local.sh"
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "squeue", "sinfo")
SEARCHED = f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"  # as slurm-local.sh searches
MISSING = [program for program in PROGRAMS if shutil.which(program, path=SEARCHED) is None]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        bool(MISSING) or os.geteuid() != 0,
        reason=f"needs root and Debian's slurm-wlm and munge (missing: {MISSING}); .ci/run "
        "installs them",
    ),
]
# local-hetero's groups as two kinds of node in slurm-local.sh's partition. The slow kind's
# emulated speed stretches a step to about 0.6 s (by sleeping), so that a cancel sent after the
# first checkpoint lands with steps still to run.
CLUSTER = """groups:
  - name: fast
    accelerator: cpu
    nodes: 1
    devices_per_node: 1
    speed: 1.0
    slurm: {partition: local, time: "0:10:00"}
  - name: slow
    accelerator: cpu
    nodes: 1
    devices_per_node: 1
    speed: 0.05
    slurm: {partition: local, time: "0:10:00"}
"""
STEPS = 4
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}


class Slurm:
    """slurm-local.sh's Slurm: its commands, with the SLURM_CONF that reaches it."""

    def __init__(self, conf: str):
        self.env = {**environment(), "SLURM_CONF": conf}

    def run(self, *command: str) -> str:
        done = subprocess.run(
            command, env=self.env, capture_output=True, text=True, timeout=30, check=False
        )
        assert done.returncode == 0, f"{' '.join(command)}: {done.stderr}"
        return done.stdout

    def submit(self, script: Path) -> int:
        output = f"--output={script.parent / 'job-%j.out'}"
        return int(self.run("sbatch", "--parsable", output, str(script)).split(";")[0])

    def components(self, job: int) -> list[dict[str, str]]:
        """Each component's fields as `scontrol show job` gives them (a finished job's too, for
        MinJobAge's 300 s)."""
        lines = self.run("scontrol", "show", "job", "--oneliner", str(job)).splitlines()
        return [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in lines]

    def wait_until_ended(self, job: int) -> list[dict[str, str]]:
        # sbatch --wait polls at growing intervals (up to 32 s here): too slow for a test
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            components = self.components(job)
            if all(c["JobState"] in ENDED for c in components):
                return components
            assert time.monotonic() < deadline, f"job {job} still running: {components}"
            time.sleep(0.5)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """Slurm for this module's tests, its state and logs in a test folder; at the end every job
    is cancelled and slurm-local.sh stops each daemon it started."""
    started = subprocess.Popen(
        ["bash", str(SLURM_LOCAL), "bash", "-c", 'echo "$SLURM_CONF"; exec cat > /dev/null'],
        env={**os.environ, "TMPDIR": str(tmp_path_factory.mktemp("slurm-local"))},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its daemons with it, should it have to be killed below
    )
    try:
        ready, _, _ = select.select([started.stdout], [], [], 60)
        conf = started.stdout.readline().strip() if ready else ""
        assert conf, f"slurm-local.sh did not start: {started.poll()=}"
        yield Slurm(conf)
        jobs = Slurm(conf).run("squeue", "--noheader", "--format=%i").split()
        if jobs:
            Slurm(conf).run("scancel", *jobs)
        started.stdin.close()
        assert started.wait(60) == 0
        assert "stopped" in started.stderr.read()
    finally:
        if started.poll() is None:
            os.killpg(started.pid, 9)
            started.wait(10)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("slurm")
    (folder / "cluster.yaml").write_text(CLUSTER)
    (folder / "plan.yaml").write_text(LOCAL_PLAN)
    return folder


@pytest.fixture(scope="module")
def single_node_losses(folder):
    """The same plan trained by `hethub train` on this machine, unbroken. It starts at once and
    is read when a test needs it, so that it runs beside the first job (both mostly sleep)."""
    command = [
        *(sys.executable, "-m", "hethub", "train", "--cluster", "cluster.yaml"),
        *("--plan", "plan.yaml", "--run-dir", "single", "--steps", str(STEPS), "--timeout", "60"),
    ]
    with ThreadPoolExecutor(1) as pool:
        training = pool.submit(
            subprocess.run,
            command,
            cwd=folder,
            env=environment(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )

        def losses() -> list[float]:
            done = training.result()
            assert done.returncode == 0, done.stderr
            return [m["loss"] for m in metrics(folder / "single")]

        yield losses


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def job_script(folder: Path, name: str, rendezvous_port: int) -> Path:
    """`hethub launch slurm` for the module's cluster and plan, into folder/name."""
    assert (
        main(
            [
                *("launch", "slurm", "--cluster", str(folder / "cluster.yaml")),
                *("--plan", str(folder / "plan.yaml"), "--run-dir", str(folder / name / "run")),
                *("--out", str(folder / name), "--steps", str(STEPS), "--checkpoint-every", "1"),
                *("--port", str(rendezvous_port), "--python", sys.executable, "--timeout", "60"),
            ]
        )
        == 0
    )
    return folder / name / "job.sbatch"


def job_output(script: Path, job: int) -> str:
    return (script.parent / f"job-{job}.out").read_text()


def test_the_two_component_job_trains_the_single_node_losses(slurm, folder, single_node_losses):
    store = rendezvous_store(TIMEOUT_S)  # held here, so that no agent races for its port
    script = job_script(folder, "whole", store.port)
    job = slurm.submit(script)
    components = slurm.wait_until_ended(job)
    assert [c["JobState"] for c in components] == ["COMPLETED"] * 2, job_output(script, job)
    assert sorted(c["NodeList"] for c in components) == ["n0", "n1"]  # one component a node
    assert [m["step"] for m in metrics(script.parent / "run")] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in metrics(script.parent / "run")] == single_node_losses()


def test_a_job_cancelled_and_submitted_again_resumes_bit_for_bit(slurm, folder, single_node_losses):
    store = rendezvous_store(TIMEOUT_S)  # one store for both jobs: each meets under its job id
    script = job_script(folder, "cancelled", store.port)
    checkpoints = script.parent / "run" / "checkpoints"
    job = slurm.submit(script)
    deadline = time.monotonic() + TIMEOUT_S
    while not (checkpoints.is_dir() and any(checkpoints.iterdir())):
        running = slurm.components(job)
        assert all(c["JobState"] not in ENDED for c in running), job_output(script, job)
        assert time.monotonic() < deadline, f"no checkpoint from job {job}: {running}"
        time.sleep(0.2)
    # what Slurm sends a job's steps before a time limit or a preemption (--signal)
    slurm.run("scancel", "--signal=TERM", str(job))
    stopped = slurm.wait_until_ended(job)
    assert all(c["JobState"] != "COMPLETED" for c in stopped), job_output(script, job)
    said = job_output(script, job)  # each node's agent says its stop in one line, no traceback
    assert said.count("hethub agent: stopped by SIGTERM") == 2 and "Traceback" not in said, said
    assert metrics(script.parent / "run")[-1]["step"] < STEPS  # stopped with steps to run

    again = slurm.submit(script)  # the same script: it finds the run and resumes it
    ended = slurm.wait_until_ended(again)
    assert [c["JobState"] for c in ended] == ["COMPLETED"] * 2, job_output(script, again)
    assert [m["step"] for m in metrics(script.parent / "run")] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in metrics(script.parent / "run")] == single_node_losses()
