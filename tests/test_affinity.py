"""Ranks bound to their own cores when they have one each, as profiled and as run."""

import contextlib
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


@pytest.mark.slow
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


@pytest.mark.slow
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


def _listening_sockets(port: int) -> set[str]:
    """The kernel's names (socket:[inode]) of the sockets listening on TCP ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state, inode = (line.split()[i] for i in (1, 3, 9))
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                found.add(f"socket:[{inode}]")
    return found


def _rendezvous_holder(rank: int, world: int, caller: int) -> tuple[int, bool]:
    """The port this rank met the others at, and whether ``caller`` holds its listening socket."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    held = set()
    for fd in Path(f"/proc/{caller}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed since listed (another rank's connection)
            held.add(os.readlink(fd))
    return store.port, bool(_listening_sockets(store.port) & held)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_ranks_meet_at_a_port_their_caller_has_held_since_before_they_started():
    # A port picked free, released, and bound again by rank 0 once started could be taken by
    # another process in between (a user's test_affinity failed so). Held by run_ranks' caller,
    # which gave it to the ranks, it was bound before they started and is never free meanwhile.
    ((port, held), other) = run_ranks(_rendezvous_holder, 2, os.getpid(), timeout_s=60)
    assert held and other == (port, True)


@pytest.mark.slow
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
