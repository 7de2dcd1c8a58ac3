"""Ranks bound to their own cores when they have one each, as profiled and as run."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hethub.runtime.affinity import cores_for
from hethub.runtime.spawn import run_ranks


def test_each_rank_gets_an_equal_contiguous_share_of_the_cores():
    assert [cores_for(r, 2, [0, 1]) for r in range(2)] == [[0], [1]]
    assert [cores_for(r, 2, [3, 5, 6, 7, 9]) for r in range(2)] == [[3, 5], [6, 7]]
    assert cores_for(0, 1, [0, 1]) == [0, 1]


def test_more_ranks_than_cores_are_left_to_the_operating_system():
    assert cores_for(0, 4, [0, 1]) is None
    assert cores_for(3, 3, [0, 1]) is None


def _my_cores(rank: int, world: int) -> list[int]:
    return sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and 2 cores to bind 2 ranks apart",
)
def test_profiling_ranks_are_bound_apart_and_oversubscribed_ones_are_not():
    cores = sorted(os.sched_getaffinity(0))
    two = run_ranks(_my_cores, 2, timeout_s=60)
    assert two == [cores_for(0, 2, cores), cores_for(1, 2, cores)]
    assert not set(two[0]) & set(two[1])
    many = len(cores) + 1
    assert run_ranks(_my_cores, many, timeout_s=60) == [cores] * many


def _session(rank: int, world: int) -> bool:
    return os.getsid(0) == os.getpid()


@pytest.mark.skipif(not hasattr(os, "setsid"), reason="sessions are POSIX")
def test_profiling_ranks_run_each_in_a_session_of_its_own_as_torchrun_starts_workers():
    assert run_ranks(_session, 2, timeout_s=60) == [True, True]


def _wait_forever(rank: int, world: int, folder: str) -> None:
    pid = os.getpid()
    with open(os.path.join(folder, f"rank-{rank}.pid"), "w") as f:
        f.write(str(pid))
    while True:
        time.sleep(1)


def _gone(pid: int) -> bool:
    """Exited (a zombie nobody reaped counts: it runs no more)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_profiling_ranks_die_with_the_process_that_started_them(tmp_path):
    # A SIGKILLed hethub train, profile or validate runs no code: its measuring processes, each
    # in a session of its own, would compute on, orphans taking the cores from the next run.
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); from test_affinity import _wait_forever; "
        "from hethub.runtime.spawn import run_ranks; "
        "run_ranks(_wait_forever, 1, sys.argv[2], timeout_s=60)"
    )
    log = tmp_path / "stderr.txt"  # and the killed starter's resource tracker's complaints
    with log.open("w") as stderr:
        starter = subprocess.Popen(
            [sys.executable, "-c", script, str(Path(__file__).parent), tmp_path], stderr=stderr
        )
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("rank-*.pid")):
            assert starter.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        pids = [int(p.read_text()) for p in tmp_path.glob("rank-*.pid")]
    finally:
        starter.kill()
        starter.wait()
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [pid for pid in pids if not _gone(pid)]
    for pid in alive:  # not to leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"measuring processes {alive} outlived their SIGKILLed parent"
