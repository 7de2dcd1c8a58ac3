"""What keeps a long run's workers honest with the machine around them: they die with the agent
that started them, a scheduler's SIGTERM (or a Ctrl-C) becomes a request to stop after the
current step, and a rank that stops answering is named by the ranks that waited for it.

Each worker reaches the others' records through torchrun's agent store (MASTER_ADDR and
MASTER_PORT: with TORCHELASTIC_USE_AGENT_STORE the agent hosts it, so it outlives any worker).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from hethub.runtime.torch_support import agent_store, agent_store_shared

LAUNCHED_BY_HETHUB = "HETHUB_LAUNCHED"
"""Set in the workers' environment when `hethub train` is their agent (not the user's torchrun):
it reports a stop in one line of its own, and reads from RUN_DIR/stopped.json (STOPPED) a stop
that a restart would only repeat."""

STOPPED = "stopped.json"
"""In the run directory: why the workers stopped the run for good, so that torchrun does not
restart them into it (under `hethub train` they then exit 0, and it reads this record):
{"reason": "non-finite loss", "step": N} (exit 1), or {"reason": "error", "error": LINE}, an
error that would repeat (a damaged checkpoint, a checkpoint of another model, a plan that cannot
be built; exit 2, the line said once)."""

PR_SET_PDEATHSIG = 1
"""prctl(2)'s option: the signal this process gets when the thread that started it ends."""


def die_with_parent() -> None:
    """SIGKILL this process when its parent (torchrun's agent, or `hethub train`) dies.

    torchrun starts each worker in a session of its own (start_new_session), so a SIGKILL of
    the agent or of its process group reaches no worker: they would train on, orphans holding
    the devices. The kernel's parent-death signal is the one guard that holds when the parent
    cannot run any code of its own. Linux only; elsewhere a no-op."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: no prctl
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)


def die_with(pid: int) -> None:
    """SIGKILL this process when process ``pid`` ends, from a daemon thread waiting on a pidfd
    of it (Linux 5.3 and later; elsewhere a no-op). For a process whose parent is not the one
    to die with: run_ranks' ranks are forked by multiprocessing's fork server, which lives as
    long as any of them does, so its death (die_with_parent) never comes."""
    try:
        handle = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd here, or ``pid`` has already ended
        if not _running(pid):
            os.kill(os.getpid(), signal.SIGKILL)
        return

    def wait() -> None:
        select.select([handle], [], [])  # readable once the process has ended
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, name="die-with", daemon=True).start()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: it exists
        return True
    return True


def bind_group_defaults_before_init() -> None:
    """Import torch.distributed.nn before any process group exists.

    Its functions default to ``group=group.WORLD``, evaluated when the module is first imported:
    imported after init_process_group (torch._dynamo's first import brings it in, e.g. with the
    first optimizer or Stage), they hold the default group for the life of the interpreter, and
    destroy_process_group leaves its gloo threads running. At exit the thread that finishes the
    last collective then frees its tensors while Python is finalizing and the process aborts
    ("terminate called without an active exception"): one profiling node in ten here, and its
    torchrun agent then waits out its timeout. Imported first, the defaults are None."""
    import torch.distributed.nn  # noqa: F401


def init_process_group(backend: str, timeout: timedelta, rank: int | None = None) -> None:
    """torch.distributed.init_process_group, in a store of this restart attempt's own, as
    ``rank`` (None: torchrun's RANK; hethub.runtime.nodes.claim_plan_rank gives the plan's).

    Under torchrun with the agent's store (TORCHELASTIC_USE_AGENT_STORE), torch 2.13's env://
    rendezvous reuses the agent's TCPStore unprefixed ("we create a new TCPStore for every
    retry", it says; the c10d rendezvous keeps one). After a restart, the new workers can read
    the dead workers' gloo addresses and fail with "Connection refused" (half of the restarts
    here). Every group then lives under a prefix of TORCHELASTIC_RESTART_COUNT."""
    bind_group_defaults_before_init()
    rank = int(os.environ["RANK"]) if rank is None else rank
    world_size = int(os.environ["WORLD_SIZE"])
    if not agent_store_shared():  # env://: MASTER_ADDR and MASTER_PORT are rank 0's to serve
        dist.init_process_group(backend, timeout=timeout, rank=rank, world_size=world_size)
        return
    store = agent_store(timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"hethub/attempt-{attempt}/groups", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


class StopRequest:
    """SIGTERM (a scheduler's preemption, or the agent stopping the workers) and SIGINT (a
    Ctrl-C the agent forwards) ask this worker to stop after the current step: the training loop
    reads ``signal`` and shares it with every rank, so that all stop after the same step and
    checkpoint it."""

    HANDLED = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signal: int | None = None
        for handled in self.HANDLED:
            signal.signal(handled, self._received)

    def _received(self, signum: int, _frame) -> None:
        self.signal = self.signal or signum

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal: 128 + its number."""
        return 128 + (self.signal or 0)


class Heartbeat:
    """Every rank counts up a key of its own in the agent store, from a thread, while its
    process runs. A stopped (SIGSTOP), dead or cut-off rank's count stands still while the ranks
    that wait for it in a collective still count: after a collective times out, the counts that
    did not move in a few beats name the ranks that did not answer. Counts, not clocks: the
    nodes' clocks need not agree."""

    def __init__(self, rank: int, world: int, interval_s: float, timeout_s: float) -> None:
        self.rank, self.world, self.interval_s = rank, world, interval_s
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"hethub/attempt-{attempt}"
        self.timeout = timedelta(seconds=max(timeout_s, 10 * interval_s))
        self.store = self._connect()
        who = {"pid": os.getpid(), "host": socket.gethostname()}
        self.store.set(f"{self.prefix}/who/{rank}", json.dumps(who))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="hethub-heartbeat", daemon=True)
        self._thread.start()

    def _connect(self) -> dist.TCPStore:
        return agent_store(self.timeout)

    def _beat(self) -> None:
        store = self._connect()  # one client per thread: a store client is not shared
        key = f"{self.prefix}/beat/{self.rank}"
        while not self._stop.is_set():
            with contextlib.suppress(RuntimeError):  # the agent is going away: nothing to tell
                store.add(key, 1)
            self._stop.wait(self.interval_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.interval_s)

    def _counts(self) -> list[int]:
        return [self.store.add(f"{self.prefix}/beat/{r}", 0) for r in range(self.world)]

    def silent_ranks(self) -> list[int]:
        """The ranks whose count did not move over three beats (this rank's own always does)."""
        before = self._counts()
        time.sleep(3 * self.interval_s)
        after = self._counts()
        return [r for r in range(self.world) if r != self.rank and after[r] == before[r]]

    def who(self, rank: int) -> dict:
        return json.loads(self.store.get(f"{self.prefix}/who/{rank}"))

    def first_to_report(self) -> bool:
        """True for one rank only: the others that timed out too stay quiet."""
        return self.store.add(f"{self.prefix}/hang-reported", 1) == 1

    def stop_silent_local_peers(self, ranks: list[int]) -> None:
        """SIGKILL the silent ranks that run on this host: a SIGSTOPped process ignores the
        agent's SIGTERM until its shutdown timeout, and the restart (or the end) waits on it."""
        here = socket.gethostname()
        for rank in ranks:
            who = self.who(rank)
            if who["host"] == here:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(who["pid"], signal.SIGKILL)

    def alive_here(self, rank: int) -> bool | None:
        """Whether the rank's process still runs (a zombie does not): None when it runs on
        another host, where this rank cannot tell a dead process from a silent one."""
        who = self.who(rank)
        if who["host"] != socket.gethostname():
            return None
        try:
            # /proc/PID/stat: "PID (name) STATE ...": Z (zombie) and X (dead) have ended.
            state = Path(f"/proc/{who['pid']}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        return state not in ("Z", "X")
