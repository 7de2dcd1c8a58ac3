"""Starting a prepared job's workers on this machine through torchrun, and watching them.

`hethub train` is itself the torchrun agent of its workers: it parses torchrun's own flags and
runs torchrun's launcher (torch.distributed.run's config_from_args, then the rendezvous and the
elastic agent: hethub.runtime.torch_support.launch) in this process, rather than a `torchrun`
child whose only record of a failure is a traceback on stderr. So it keeps the agent's log in
RUN_DIR/logs/agent.log, reads each failure from torchelastic's own record of it (rank, exit code,
error file) as the agent does and says it in one line, and when it is killed its workers die
with it (each worker asks the kernel for that: hethub.runtime.supervision).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import uuid
from pathlib import Path
from typing import Self

from hethub.jobs import Job, plan_devices
from hethub.messages import logger
from hethub.runtime.checkpoint_folders import latest_checkpoint, read_meta
from hethub.runtime.torch_support import is_death_signal

DEFAULT_MAX_RESTARTS = 3
"""Restarts of the workers after a failure (`hethub train --max-restarts`). A worker lost to
the OOM killer, a flaky link or a node's hiccup costs the steps since the last checkpoint and
a few seconds of start-up; a failure that repeats (a bug) costs three start-ups more before
the run stops. A non-finite loss, or an error that would repeat (a damaged checkpoint, one of
another model, a plan that cannot be built), is not a failure of this kind: every rank stops
cleanly, records why (hethub.runtime.supervision.STOPPED), and nothing restarts."""


def launch(job: Job, *, as_json: bool, max_restarts: int = DEFAULT_MAX_RESTARTS) -> int:
    """Start the job's workers on this machine through torchrun's launcher; the exit status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import config_from_args, parse_args

    from hethub.runtime import torch_support
    from hethub.runtime.supervision import LAUNCHED_BY_HETHUB, STOPPED

    run = job.run.path
    logs = run / "logs"
    logs.mkdir(exist_ok=True)
    worker = ["-m", "hethub.runtime.worker", str(run)]
    worker += ["--json"] if as_json else []
    worker += ["--resume"] if job.resume_from is not None else []
    # One thread per rank (the engine sets it too); saying so spares torchrun's warning banner.
    os.environ["OMP_NUM_THREADS"] = "1"
    # The workers leave reporting a stop to this process: one line, not one from each.
    os.environ[LAUNCHED_BY_HETHUB] = "1"
    config, entrypoint, arguments = config_from_args(
        parse_args(
            [
                # torchrun --standalone, spelled out (torch.distributed.run.run does this):
                # a c10d rendezvous on a free local port.
                "--rdzv-backend=c10d",
                "--rdzv-endpoint=localhost:0",
                f"--rdzv-id={uuid.uuid4()}",
                f"--nproc-per-node={plan_devices(job.plan)}",
                f"--max-restarts={max_restarts}",
                f"--log-dir={logs}",
                *worker,
            ]
        )
    )
    (run / STOPPED).unlink(missing_ok=True)
    watcher = AgentLog(logs / "agent.log", job, max_restarts)
    try:
        with watcher:
            torch_support.launch(config, entrypoint, arguments, watcher.failed)
    except ChildFailedError as failed:
        stopped = _stopped_for_good(run / STOPPED)
        if stopped and "error" in stopped:  # the others failed waiting for the rank that met it
            _say(f"error: {stopped['error']}")
            return 2
        _say(f"error: {watcher.failure_line(failed)}; the agent's log: {logs / 'agent.log'}")
        return 1
    except SignalException as stopped:
        sig = signal.Signals(stopped.sigval)
        step = _latest_step(job)
        kept = "no checkpoint yet" if step is None else f"its latest checkpoint is step {step}"
        _say(f"stopped by {sig.name}; {kept}; resume with: hethub train --resume {run}")
        return 128 + sig.value
    stopped = _stopped_for_good(run / STOPPED)
    if stopped is None:
        return 0
    if "error" in stopped:  # every rank that met it recorded it: said once, here
        _say(f"error: {stopped['error']}")
        return 2
    return 1  # a non-finite loss: rank 0 has said it


def _stopped_for_good(record: Path) -> dict | None:
    """What the workers recorded when they stopped the run for good (None: they did not)."""
    try:
        return json.loads(record.read_text())
    except FileNotFoundError:
        return None


def _latest_step(job: Job) -> int | None:
    """The step of the run's latest complete checkpoint (None: none yet)."""
    checkpoint = latest_checkpoint(job.run.checkpoints)
    return None if checkpoint is None else read_meta(checkpoint)["step"]


def _stop_at_once(signum: int, _frame) -> None:
    _say("stopped at once: the step in progress is lost, the latest checkpoint is kept")
    os._exit(128 + signum)


def _say(message: str) -> None:
    logger("train").info(message)


class AgentLog(logging.Handler):
    """Takes torchrun's agent log for the length of a launch: every record into ``path``, none
    on the console, and from one of them hethub's own line: a first Ctrl-C's notice (told apart
    by torch's message template, kept with the torch it was checked on in
    hethub.runtime.torch_support). It is told of each failure of the workers (``failed``), and
    says it (the rank's group and stage, its signal or status) where the agent restarts them.
    For the launch's length every torch.distributed logger says INFO (the agent's restart
    records, kept in the log, are INFO ones); each gets its own level back after."""

    LOGGER = "torch.distributed"

    def __init__(self, path: Path, job: Job, max_restarts: int) -> None:
        super().__init__(level=logging.INFO)
        self.path, self.job, self.max_restarts = path, job, max_restarts
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s] %(message)s"))
        self.failures = 0

    def __enter__(self) -> Self:
        self.file = self.path.open("a", encoding="utf-8")
        logger = logging.getLogger(self.LOGGER)
        self.saved = logger.handlers[:], logger.propagate
        logger.handlers, logger.propagate = [self], False
        # torch's loggers take their level from LOGLEVEL (WARNING by default) when imported;
        # the restart record is an INFO one.
        self.saved_levels = {
            name: logging.getLogger(name).level
            for name in list(logging.root.manager.loggerDict)
            if name.startswith(self.LOGGER)
        }
        for name in self.saved_levels:
            logging.getLogger(name).setLevel(logging.INFO)
        return self

    def __exit__(self, *_) -> None:
        logger = logging.getLogger(self.LOGGER)
        logger.handlers, logger.propagate = self.saved
        for name, level in self.saved_levels.items():
            logging.getLogger(name).setLevel(level)
        self.file.close()

    def emit(self, record: logging.LogRecord) -> None:
        self.file.write(self.format(record) + "\n")
        self.file.flush()
        if is_death_signal(record):
            _say(
                "stopping after the current step and a checkpoint "
                "(Ctrl-C again stops at once, losing the step)"
            )
            # torchrun's own handler would wait for the workers a second time; this process
            # ends instead, and its workers with it (they die with their parent).
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, _stop_at_once)

    def failed(self, rank: int | None, exitcode: int | None, error_file: str | None) -> None:
        """The workers failed, ``rank`` first (None: the agent found the group unhealthy with no
        rank's exit): said where the agent restarts them; a failure past the restarts is said
        once the launch ends (failure_line)."""
        self.failures += 1
        if self.failures > self.max_restarts:
            return
        step = _latest_step(self.job)
        since = "step 0 (no checkpoint yet)" if step is None else f"step {step}"
        what = "a worker failed" if rank is None else self._failure(rank, exitcode, error_file)
        _say(
            f"{what}; restarting the workers from {since} "
            f"(restart {self.failures} of {self.max_restarts})"
        )

    def _rank(self, rank: int) -> str:
        # hethub train starts every rank on this machine: the local rank is the plan's rank.
        from hethub.spec.topology import build_topology

        return build_topology(self.job.plan, self.job.cluster).ranks[rank].describe()

    def _failure(self, rank: int, exitcode: int, error_file: str | None) -> str:
        """'RANK died of SIGNAL' or 'RANK exited with status N (its error: FILE)'."""
        line = f"{self._rank(rank)} {self._ended(exitcode)}"
        if exitcode > 0 and error_file and Path(error_file).is_file():
            line += f" (its error: {error_file})"
        return line

    @staticmethod
    def _ended(exitcode: int) -> str:
        if exitcode < 0:
            return f"died of {signal.Signals(-exitcode).name}"
        return f"exited with status {exitcode}"

    def failure_line(self, failed) -> str:
        """One line for torchelastic's ChildFailedError: the first rank to fail, and how."""
        rank, failure = failed.get_first_failure()
        return self._failure(rank, failure.exitcode, failure.error_file)
