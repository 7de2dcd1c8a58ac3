"""One process of a training run under torchrun: its engine, the steps, the metrics, the
checkpoints, and (on rank 0) the run's records: metrics.jsonl, trace.json and loss.png.

It reads the plan and the cluster from the run directory that `hethub train` prepared; it never
plans: torchrun starts it as `python -m hethub.runtime.worker RUN_DIR [--json] [--resume]`. Rank 0
alone writes files and prints: one JSON object per step on stdout with --json, progress on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys

import torch
import torch.distributed as dist

from hethub.corpus import open_corpus
from hethub.errors import HethubError
from hethub.memo import memo_scope
from hethub.messages import logger
from hethub.report.terminal import plural
from hethub.runtime.affinity import bind_rank
from hethub.runtime.rundir import RunDir, RunSettings
from hethub.runtime.step_log import say
from hethub.runtime.supervision import (
    LAUNCHED_BY_HETHUB,
    STOPPED,
    Heartbeat,
    StopRequest,
    die_with_parent,
    init_process_group,
)
from hethub.runtime.torch_support import require_supported_torch
from hethub.runtime.trainer import Trainer, TrainingJob
from hethub.spec import load_cluster, load_model, load_plan
from hethub.spec.cluster import ClusterSpec
from hethub.spec.model import ModelSpec
from hethub.spec.plan import Plan
from hethub.spec.topology import Topology, build_topology


@memo_scope()  # one Memo for the rank's whole run
def train(job: TrainingJob, *, resume: bool, as_json: bool, rank: int | None = None) -> int:
    """Train the job's plan from its start (or its latest checkpoint) to its settings' steps, as
    ``rank`` of the plan (None: torchrun's RANK); the exit status: 0, 1 when the loss went
    non-finite, 128 + N when signal N stopped it."""
    run, settings, topology = job.run, job.settings, job.topology
    world = int(os.environ["WORLD_SIZE"])
    if world != topology.world_size:
        raise HethubError(
            f"{run.plan}: the plan needs {plural(topology.world_size, 'process', 'processes')}, "
            f"torchrun started {world} "
            f"(give --nproc-per-node x nodes = {topology.world_size})"
        )
    die_with_parent()
    stop = StopRequest()
    # torchrun restarted the workers after a failure: they go on from the last checkpoint.
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    torch.set_num_threads(1)
    bind_rank(int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))
    init_process_group("gloo", datetime.timedelta(seconds=settings.timeout_s), rank)
    rank = dist.get_rank()
    heartbeat = Heartbeat(rank, world, HEARTBEAT_S, settings.timeout_s)
    try:
        return Trainer(job, stop, as_json=as_json).train(resume=resume, restarted=restarted)
    except RuntimeError:  # dist.DistError is one: a collective that failed or timed out
        if _lost_peers(heartbeat, topology, stop, settings.timeout_s):
            return 1
        raise  # nobody is missing: a fault of this rank's own, with its traceback
    finally:
        heartbeat.close()
        with contextlib.suppress(RuntimeError):  # a group whose peers are gone
            dist.destroy_process_group()


HEARTBEAT_S = 0.5
"""How often a rank says it is alive (hethub.runtime.supervision.Heartbeat): a silent rank is
named within a few beats of --timeout."""


def _lost_peers(heartbeat: Heartbeat, topology: Topology, stop, timeout_s: float) -> bool:
    """After a failed collective: whether peers went missing (or the agent is stopping the
    workers), naming, once for the whole job, the ranks that stopped answering."""
    silent = heartbeat.silent_ranks()
    # Ranks whose process ended: the agent reports their exit; the survivors only follow.
    gone = [r for r in silent if heartbeat.alive_here(r) is False]
    hung = [r for r in silent if r not in gone]
    if hung and heartbeat.first_to_report():
        say(
            f"error: {', '.join(topology.ranks[r].describe() for r in hung)} did not answer "
            f"within --timeout {timeout_s:g} s (stopped, hung or cut off); stopping the workers"
        )
        heartbeat.stop_silent_local_peers(hung)
    return bool(silent) or stop.signal is not None


def run_job(
    run: RunDir,
    settings: RunSettings,
    cluster: ClusterSpec,
    plan: Plan,
    model: ModelSpec,
    *,
    resume: bool,
    as_json: bool,
    rank: int | None = None,
) -> int:
    """This process's part of the job, as ``rank`` of the plan (None: torchrun's RANK): its
    corpus and topology, then train()."""
    job = TrainingJob(
        run,
        settings,
        cluster,
        plan,
        model,
        topology=build_topology(plan, cluster),
        corpus=open_corpus(settings.data),
    )
    return train(job, resume=resume, as_json=as_json, rank=rank)


def main(argv: list[str] | None = None) -> int:
    """A worker that `hethub train` started: everything comes from the prepared run directory.
    Bad input is one line and never restarted: said by hethub train (_stop_for_good), or under
    the user's torchrun on stderr with exit status 2, as the CLI says it."""
    parser = argparse.ArgumentParser(prog="python -m hethub.runtime.worker")
    parser.add_argument("run_dir", help="the run directory hethub train prepared")
    parser.add_argument("--json", action="store_true", help="one JSON object per step on stdout")
    parser.add_argument("--resume", action="store_true", help="continue from its last checkpoint")
    args = parser.parse_args(argv)
    run = RunDir(args.run_dir)
    try:
        require_supported_torch()
        plan = load_plan(run.plan)
        settings = run.read_settings()
        model = load_model(
            plan.model, relative_to=run.path, source=str(run.plan), seq_len=settings.seq_len
        )
        code = run_job(
            run,
            settings,
            load_cluster(run.cluster),
            plan,
            model,
            resume=args.resume,
            as_json=args.json,
        )
    except HethubError as error:
        code = _stop_for_good(run, error)
    # Everything is written, closed and synced (checkpoints, metrics, trace, plot): the worker
    # skips the interpreter's teardown of torch, 1-2 s for which the agent waits at every end.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _stop_for_good(run: RunDir, error: HethubError) -> int:
    """This worker's exit status for an error that every attempt would meet again. Under hethub
    train: 0, or torchrun would restart the workers into it, and RUN_DIR/stopped.json holds the
    line hethub train says once (each rank that met it writes the same). Under the user's
    torchrun, or where the record cannot be written: the line, and 2."""
    if LAUNCHED_BY_HETHUB in os.environ:
        with contextlib.suppress(OSError):
            run.write_json(run.path / STOPPED, {"reason": "error", "error": str(error)})
            return 0
    logger("train").error(f"error: {error}")
    return 2


if __name__ == "__main__":
    main()
