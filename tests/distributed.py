"""Run a function on N gloo ranks in fresh processes: a free port, bounded waits, cleanup."""

from __future__ import annotations

import datetime
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(
        1
    )  # ranks share the cores: thread pools spinning against each other cost ~3x
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S)
        )
        results[rank] = ("ok", fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - every failure goes back to the test as text
        results[rank] = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout_s: float = TIMEOUT_S) -> list:
    """fn(rank, world, *args) on every rank; its return values, in rank order. Raises on error or hang."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = free_port()
        procs = [
            ctx.Process(target=_entry, args=(r, world, port, fn, args, results))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
            p.join()
        if alive:
            raise TimeoutError(f"{len(alive)} of {world} ranks still running after {timeout_s} s")
        out = []
        for r in range(world):
            status, value = results.get(r, ("error", f"rank {r} exited without a result"))
            if status != "ok":
                raise RuntimeError(f"rank {r} failed:\n{value}")
            out.append(value)
        return out
