"""Runs that survive what a cluster does to them, through `hethub train` and its real torchrun
agent: a worker killed mid-run is restarted and the run ends with the losses of one that never
failed; SIGTERM ends in a checkpoint and exit 143; a SIGKILLed `hethub train` leaves no worker;
a stopped worker is named within the timeout; a non-finite loss stops the run with a finite
checkpoint. Every wait is bounded and every process is cleaned up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

import pytest
import torch
from test_train_cli import CLUSTER, PLAN, _workers_of, hethub

pytestmark = [
    pytest.mark.slow,  # every test runs hethub train's processes
    pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the workers through /proc"),
]

STEPS, EVERY = 20, 2
COMMON = ["--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--seed", "5", "--lr", "1e-3"]
COMMON += ["--cluster", "cluster.yaml", "--plan", "plan.yaml", "--json", "--timeout", "30"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("long")
    (folder / "cluster.yaml").write_text(CLUSTER)
    (folder / "plan.yaml").write_text(PLAN)
    return folder


@pytest.fixture(scope="module")
def uninterrupted(folder) -> list[float]:
    done = hethub(folder, "train", *COMMON, "--run-dir", "runs/uninterrupted")
    assert done.returncode == 0, done.stderr
    return losses(folder / "runs/uninterrupted")


def losses(run: Path) -> list[float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))  # none twice
    return [r["loss"] for r in records]


class Training:
    """`hethub train` in the background, killed with its workers however the test ends."""

    def __init__(self, folder: Path, run: str, *args: str) -> None:
        self.folder, self.run = folder, run
        self.process = subprocess.Popen(
            [sys.executable, "-m", "hethub", "train", *args, "--run-dir", run],
            cwd=folder,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    def wait_for(self, path: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        target = self.folder / self.run / path
        while not target.exists():
            assert self.process.poll() is None, self.process.communicate()[1]
            assert time.monotonic() < deadline, f"no {target} after {timeout} s"
            time.sleep(0.02)

    def workers(self) -> list[int]:
        """The workers' pids in rank order (hethub train's ranks are torchrun's local ranks)."""
        return sorted(_workers_of(self.folder, self.run), key=local_rank)

    def finish(self, timeout: float = 120) -> tuple[int, str]:
        _, stderr = self.process.communicate(timeout=timeout)
        return self.process.returncode, stderr

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_) -> None:
        for pid in self.workers():
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate(timeout=30)


def local_rank(pid: int) -> int:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(int(v.split(b"=")[1]) for v in environ if v.startswith(b"LOCAL_RANK="))


def alive(pids: list[int]) -> list[int]:
    """The pids that still run (a zombie has ended)."""
    running = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            running.append(pid)
    return running


def test_a_killed_worker_is_restarted_and_the_run_ends_with_the_uninterrupted_losses(
    folder, uninterrupted
):
    with Training(folder, "runs/restarted", *COMMON, "--max-restarts", "1") as run:
        run.wait_for("checkpoints/step-000004/meta.json")
        workers = run.workers()
        assert len(workers) == 2
        os.kill(workers[-1], signal.SIGKILL)  # rank 1, mid-step
        code, stderr = run.finish()
    assert code == 0, stderr
    assert "rank 1 (group amd, replica 0, stage 1) died of SIGKILL; restarting the workers" in (
        stderr
    )
    assert losses(folder / "runs/restarted") == uninterrupted  # bit for bit


def test_sigterm_ends_in_a_checkpoint_and_exit_143_and_resume_finishes_the_run(
    folder, uninterrupted
):
    with Training(folder, "runs/preempted", *COMMON) as run:
        run.wait_for("checkpoints/step-000002/meta.json")
        at = len((folder / "runs/preempted/metrics.jsonl").read_text().splitlines())
        run.process.send_signal(signal.SIGTERM)
        code, stderr = run.finish(timeout=60)
    assert code == 143, stderr
    assert "resume with: hethub train --resume runs/preempted" in stderr
    # The workers finished their step and saved on their own: torchrun's agent, which SIGKILLs
    # them after its 30 s and logs it, never had to.
    assert "forcefully exiting" not in (folder / "runs/preempted/logs/agent.log").read_text()
    # Counted in steps, not seconds: they stopped after the step under way when the signal
    # came (at + 1), or the next where it came between a step's agreement and its log line.
    saved = sorted((folder / "runs/preempted/checkpoints").glob("step-*[0-9]"))
    stopped = int(saved[-1].name.split("-")[1])
    assert max(at, EVERY) <= stopped <= at + 2
    logged = (folder / "runs/preempted/metrics.jsonl").read_text().splitlines()
    assert len(logged) == stopped  # no step after the checkpoint it stopped with
    resumed = hethub(folder, "train", "--resume", "runs/preempted", "--json")
    assert resumed.returncode == 0, resumed.stderr
    assert losses(folder / "runs/preempted") == uninterrupted


def test_a_sigkilled_hethub_train_leaves_no_worker_behind(folder):
    with Training(folder, "runs/orphans", *COMMON) as run:
        run.wait_for("metrics.jsonl")
        workers = run.workers()
        assert len(workers) == 2
        run.process.kill()
        run.process.communicate(timeout=30)
        deadline = time.monotonic() + 10
        while alive(workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert alive(workers) == []


def test_a_stopped_worker_is_named_within_the_timeout_in_one_line(folder):
    timeout = 5
    args = [*COMMON[:-1], str(timeout), "--max-restarts", "0"]  # --timeout 5
    with Training(folder, "runs/stopped", *args) as run:
        run.wait_for("metrics.jsonl")
        workers = run.workers()
        os.kill(workers[-1], signal.SIGSTOP)  # rank 1: alive, silent
        at = len((folder / "runs/stopped/metrics.jsonl").read_text().splitlines())
        # bounded: a hang detector that never fires fails here, after the timeout, a few
        # heartbeats and the workers' exit many times over
        code, stderr = run.finish(timeout=120)
    assert code == 1, stderr
    # Counted in steps, not seconds: rank 0 stopped at the first collective rank 1 missed,
    # within the step under way.
    logged = (folder / "runs/stopped/metrics.jsonl").read_text().splitlines()
    assert at <= len(logged) <= at + 1
    said = [line for line in stderr.splitlines() if "did not answer" in line]
    assert said == [
        (
            "hethub train: error: rank 1 (group amd, replica 0, stage 1) did not answer within "
            f"--timeout {timeout} s (stopped, hung or cut off); stopping the workers"
        )
    ]
    assert "Traceback" not in stderr  # torchrun's own ChildFailedError is one line too
    assert "agent's log: runs/stopped/logs/agent.log" in stderr


def test_a_non_finite_loss_stops_the_run_keeping_a_finite_checkpoint(folder):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    done = hethub(
        folder, "train", *COMMON[2:], "--steps", "10", "--checkpoint-every", "1",
        "--lr", "1e30", "--run-dir", "runs/nan",
        # the old recipe's first steps: no warm-up, clipping nor decay to tame the rate
        "--warmup-steps", "0", "--clip-grad", "0", "--weight-decay", "0",
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    run = folder / "runs/nan"
    stopped = json.loads((run / "stopped.json").read_text())["step"]
    said = [line for line in done.stderr.splitlines() if "non-finite" in line]
    assert len(said) == 1 and f"at step {stopped}" in said[0] and "rank 1" in said[0], said
    saved = sorted((run / "checkpoints").glob("step-*[0-9]"))
    assert saved and int(saved[-1].name.split("-")[1]) < stopped
    dcp_to_torch_save(saved[-1], run / "last.pt")
    state = torch.load(run / "last.pt")
    tensors = [value for value in state.values() if isinstance(value, torch.Tensor)]
    assert tensors and all(bool(torch.isfinite(t).all()) for t in tensors)
