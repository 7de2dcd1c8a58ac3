"""Run a function on N gloo ranks in fresh local processes (forked from a server that has
imported torch once): they meet at a store this process holds, every wait bounded, the
processes cleaned up whatever happens. The measuring half of the profiler needs real process
groups (TP collectives, point-to-point and all-reduce between processes), and so do the
multi-process tests, which use this too: started as torchrun starts a run's workers."""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hethub.errors import HethubError
from hethub.memo import memo_scope
from hethub.runtime.affinity import bind_rank

DEFAULT_TIMEOUT_S = 300.0
STARTUP_TIMEOUT_S = 120.0  # a fresh process imports torch before its first collective


def rendezvous_store(timeout_s: float):
    """A TCPStore served by this process on 127.0.0.1, bound to a port the kernel picks (its
    ``port``), for ranks to meet at as clients. Bound before any rank starts and held until the
    caller drops it, the port is never free for another process to take in between, as one
    picked free, released and bound again later by rank 0 was: a user's run failed so."""
    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


@dataclass(frozen=True)
class _Job:
    """What every rank of a run_ranks call is given (pickled to each process)."""

    world: int
    store_port: int
    threads: int
    timeout_s: float
    fn: Callable
    args: tuple
    purpose: str
    caller: int
    """The process that called run_ranks, which each rank dies with."""


def _entry(rank: int, job: _Job, results) -> None:
    world, threads, purpose, fn, args = job.world, job.threads, job.purpose, job.fn, job.args
    # First: a measuring process dies with the process that started it (hethub train, profile
    # or validate), even one killed by SIGKILL, which runs no code of its own to stop it (the
    # daemon flag only acts at a clean exit, and setsid below puts the process out of reach of
    # a signal to the CLI's process group). Its parent is the fork server, which lives as long
    # as its children do, so it watches run_ranks' caller itself (die_with). The module imports
    # torch.distributed, which this process has imported already (the server's preload).
    from hethub.runtime.supervision import bind_group_defaults_before_init, die_with

    die_with(job.caller)
    import torch
    import torch.distributed as dist

    # Each in a session of its own, as torchrun starts a run's workers: where the kernel groups
    # the processes of a session for CPU fairness (autogroup), ranks sharing a core are
    # scheduled as separate groups, which made a 4-rank TP run here 1.5x slower than the same
    # ranks in one session; the profile measures what the run meets.
    if hasattr(os, "setsid"):
        os.setsid()
    torch.set_num_threads(threads)
    bind_rank(rank, world)  # as the runtime binds a run's ranks
    try:
        # At run_ranks' store, named outright: not at MASTER_ADDR and MASTER_PORT, which under
        # the user's torchrun (hethub profile --cluster) name the agent's store.
        timeout = datetime.timedelta(seconds=job.timeout_s)
        store = dist.TCPStore("127.0.0.1", job.store_port, is_master=False, timeout=timeout)
        bind_group_defaults_before_init()
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        # Pickled here, by value: torch's queue would pass a tensor as a handle to this
        # process's shared memory, which is gone once the process has exited.
        with memo_scope():  # one Memo for the rank's work, gone with it
            answer = fn(rank, world, *args)
        results.put((rank, "ok", pickle.dumps(answer)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent as text
        text = traceback.format_exc()
        print(f"{purpose} rank {rank}:\n{text}", file=sys.stderr, flush=True)
        results.put((rank, "error", text))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable,
    world: int,
    *args: Any,
    threads: int = 1,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    purpose: str = "profiling",
) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks, each a fresh process with ``threads``
    torch threads; the return values (picklable) in rank order. A rank that fails, dies or is
    still running after ``timeout_s`` seconds is an error (a HethubError that starts with
    ``purpose``; a failed rank's traceback goes to stderr); every process is gone on return."""
    ctx = _context()
    results = ctx.Queue()
    store = rendezvous_store(timeout_s)  # held until every rank is gone (the finally below)
    job = _Job(world, store.port, threads, timeout_s, fn, args, purpose, os.getpid())
    procs = [ctx.Process(target=_entry, args=(r, job, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s + STARTUP_TIMEOUT_S
    out: dict[int, tuple[str, Any]] = {}
    try:
        while len(out) < world:
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise HethubError(
                        f"{purpose}: {world - len(out)} of {world} ranks still running after "
                        f"{timeout_s:g} s; stopped them"
                    ) from None
                if all(not p.is_alive() for p in procs) and results.empty():
                    missing = sorted(set(range(world)) - set(out))
                    raise HethubError(
                        f"{purpose}: rank {missing[0]} exited without a result "
                        f"(exit code {procs[missing[0]].exitcode})"
                    ) from None
                continue
            out[rank] = (status, value)
            if status != "ok":
                raise HethubError(
                    f"{purpose}: rank {rank} failed ({_last_line(value)}); its traceback is above"
                )
    finally:
        for p in procs:
            p.join(5.0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
        del store  # its server stops with its last reference
    return [pickle.loads(out[r][1]) for r in range(world)]


def _context():
    """Processes forked from a server that has imported torch and the runtime once, in this
    process's first call: a fresh spawned process imports torch itself (3 s and more here, and
    several at once share the cores), which made starting the ranks most of a small job's time
    (2 ranks: 6 s spawned, 0.3 s forked from the server). The server imports but runs nothing,
    so no thread pool or device state is forked; each rank starts its own. The ranks die with
    this process (die_with), and the server once neither is left."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOADED))  # no effect once the server runs
    return ctx


# torch._dynamo: the first optimizer a process makes imports it (torch.optim's constructors are
# wrapped by torch._disable_dynamo), 2 to 5 s here; checkpoint: torch.distributed.checkpoint.
_PRELOADED = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "hethub.runtime.engine",
    "hethub.runtime.checkpoint",
    "hethub.profiler.layers",
    "hethub.profiler.links",
)


def _last_line(text: str) -> str:
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1] if lines else "unknown error"
