"""The agent a launch's script starts on each node: torchrun's own launcher, as `python -m
torch.distributed.run` runs it, with its two ends that are no bug said in one line each rather
than in a traceback from every node:

- stopped by a signal: Slurm's warning before a time limit or a preemption (`--signal`), or a
  scancel. torchrun passes the signal to its workers, which stop after the current step with a
  checkpoint; the run resumes from the run folder.
- a worker failed more often than `--max-restarts` allows: which of this node's workers, and
  how (its own error is the line it printed above).

    python -m hethub.launchers.node_agent [torchrun's flags] -m hethub train ...
"""

from __future__ import annotations

import signal
import sys

from hethub.messages import logger


def main(argv: list[str] | None = None) -> int:
    """torchrun's main on ``argv`` (default: this process's arguments); the exit status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except SignalException as stopped:
        sig = signal.Signals(stopped.sigval)
        _say(
            f"stopped by {sig.name}: its workers stop after the current step with a "
            "checkpoint, and the run resumes from its run folder when started again"
        )
        return 128 + sig.value
    except ChildFailedError as failed:
        local_rank, failure = failed.get_first_failure()
        how = (
            f"died of {signal.Signals(-failure.exitcode).name}"
            if failure.exitcode < 0
            else f"exited with status {failure.exitcode}"
        )
        _say(f"this node's worker {local_rank} {how}, and no restart was left (its error above)")
        return 1
    return 0


def _say(message: str) -> None:
    logger("agent").info(message)


if __name__ == "__main__":
    sys.exit(main())
