"""Rank 0's record of a training run: a metrics.jsonl line, a printed line and the progress bar
each step, trace.json every --trace-every steps and at the end, loss.png, TensorBoard where it
is installed, and the one-line messages of a worker (say)."""

from __future__ import annotations

import json
from typing import NamedTuple

import torch

from hethub.comm import BRIDGE, NATIVE
from hethub.messages import logger
from hethub.report.plot import loss_plot
from hethub.report.prediction_check import PredictionCheck
from hethub.report.terminal import plural, progress_bar
from hethub.report.timeline import TimelineEvent
from hethub.report.trace import write_trace
from hethub.runtime.checkpoint_folders import (
    latest_checkpoint,
)
from hethub.runtime.rundir import RunDir
from hethub.spec.cluster import ClusterSpec
from hethub.spec.model import ModelSpec
from hethub.spec.plan import Plan
from hethub.spec.topology import Topology


class Agreed(NamedTuple):
    """What every rank agrees on after a step (_agree_on_step)."""

    moved: torch.Tensor
    """Bytes moved since the start, over every rank: (native, bridge)."""
    stop_signal: int
    """The signal some rank was asked to stop by (0: none)."""
    non_finite: int
    """How many ranks saw a non-finite loss of their own."""
    first_non_finite: int
    """The lowest of those ranks (meaningless where there are none)."""
    weights_non_finite: bool
    """Some rank found a non-finite weight (where the step checked)."""
    elapsed: float
    """The step's time: the latest end of any rank's timeline."""
    peak_memory: int | None
    """The largest device memory any rank held at its peak (None on CPUs)."""
    stage_seconds: torch.Tensor
    """Per trace leader (trace_leaders' order): its compute, communication and optimizer
    seconds."""
    busiest: tuple[int, int]
    """The most bytes any one rank sent in the step: (native, bridge)."""


def trace_leaders(topology: Topology) -> list:
    """The stage leaders of each layout's first replica: the rows of the trace and of each
    step's per-stage times (a stage's count, not the rank count)."""
    first: dict[int, int] = {}
    for r in topology.ranks:
        first.setdefault(r.pipeline, r.replica)
    return [r for r in topology.ranks if r.tp_rank == 0 and first[r.pipeline] == r.replica]


class StepLog:
    """Rank 0's records of the run: a metrics line, a printed line and the progress per step."""

    def __init__(
        self,
        run: RunDir,
        plan: Plan,
        model: ModelSpec,
        cluster: ClusterSpec,
        topology: Topology,
        as_json: bool,
    ) -> None:
        self.run, self.plan, self.model, self.topology, self.as_json = (
            run,
            plan,
            model,
            topology,
            as_json,
        )
        self.emulated = cluster.emulated
        self.prediction = (
            json.loads(run.prediction.read_text()) if run.prediction.is_file() else None
        )
        self.prediction_check = PredictionCheck(self.prediction)
        self.bar = progress_bar()
        self.board = _tensorboard(run)
        self.optimizer_state_bytes: list[int] = []  # per rank, as of the last step
        self.leaders = trace_leaders(topology)

    def step(
        self,
        step: int,
        steps: int,
        loss: float,
        agreed: Agreed,
        moved: torch.Tensor,
        *,
        lr: float | None = None,
        grad_norm: float | None = None,
        eval_loss: float | None = None,
    ) -> None:
        """``lr``: the step's rate; ``grad_norm``: its gradients' global norm, before clipping;
        ``eval_loss``: the validation loss after it, where one was computed."""
        elapsed, peak_memory = agreed.elapsed, agreed.peak_memory
        predicted = self.prediction["iteration_time_s"] if self.prediction else None
        record = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            **({"eval_loss": eval_loss} if eval_loss is not None else {}),
            "precision": self.plan.precision.value,
            "iteration_time_s": elapsed,
            "tokens_per_s": self.plan.global_batch * self.model.seq_len / elapsed,
            "predicted_iteration_s": predicted,
            # The model's FLOPs per step are the predictor's, whatever the timing.
            "model_tflops_per_device": (
                self.prediction["model_tflops_per_device"] * predicted / elapsed
                if self.prediction
                else None
            ),
            "comm_bytes": {NATIVE: int(moved[0]), BRIDGE: int(moved[1])},
            # the most that any one rank sent on each path: a funnel shows here, not in the sum
            "comm_bytes_busiest_rank": dict(zip((NATIVE, BRIDGE), agreed.busiest, strict=True)),
            "stages": [
                {
                    "pipeline": r.pipeline,
                    "replica": r.replica,
                    "stage": r.stage,
                    "group": r.group,
                    **_with_idle(agreed.stage_seconds[i].tolist(), elapsed),
                }
                for i, r in enumerate(self.leaders)
            ],
            "emulated": self.emulated,
            # The largest over the ranks of the device memory each held at its peak (None when
            # every rank runs on a CPU, where nothing counts it).
            "peak_memory_gb": peak_memory / 1e9 if peak_memory is not None else None,
            **self.prediction_check.after_step(step, elapsed),
        }
        self.run.append_metrics(record)
        if self.board:
            for name in (
                "loss",
                "eval_loss",
                "lr",
                "grad_norm",
                "tokens_per_s",
                "iteration_time_s",
                "model_tflops_per_device",
            ):
                if record.get(name) is not None:
                    self.board.add_scalar(name, record[name], step)
        if self.as_json:
            print(json.dumps(record), flush=True)
        detail = (
            f"loss {loss:.4f}"
            + (f" | eval {eval_loss:.4f}" if eval_loss is not None else "")
            + (f" | lr {lr:.3g}" if lr is not None else "")
            + (f" | grad norm {grad_norm:.3g}" if grad_norm is not None else "")
            + f" | {record['tokens_per_s']:,.0f} tokens/s | step {elapsed:.2f} s"
            + (f" (predicted {predicted:.2f} s)" if predicted else "")
            + (" | emulated speeds" if self.emulated else "")
        )
        if self.bar:
            self.bar.update("step", step, steps, detail)
        elif not self.as_json:  # a log: one line per step, for people and for grep
            logger("train").info(f"step {step}/{steps}: {detail}")

    def close(self) -> None:
        if self.bar:
            self.bar.close()
        if self.board:
            self.board.close()

    def write_trace(self, timelines: list, step: int | None) -> None:
        """trace.json: the predicted step and the trace leaders' measured one, ``step``
        (1-based; None: no step ran). ``timelines``: every rank's events, in rank order (None
        or [] for a rank that sent none: only the leaders' are drawn)."""
        events = []
        if self.prediction:
            events += [
                TimelineEvent.from_dict({**e, "source": "predicted"})
                for e in self.prediction.get("timeline", [])
            ]
        if timelines:
            for r in self.leaders:
                events += timelines[r.rank]  # the engine marks them with its rank's stage
        label = " (emulated speeds)" if self.emulated else ""
        measured = "measured step" if step is None else f"measured step {step}"
        write_trace(
            self.run.trace,
            events,
            f"hethub {self.run.path.name}: predicted and {measured}{label}",
            step=step,
        )

    def finish(
        self, timelines: list[list[TimelineEvent]], world: int, step: int | None = None
    ) -> None:
        """The run's last records: trace.json of its last step (``step``), loss.png and, with
        --json, the summary line."""
        self.close()
        self.write_trace(timelines, step)
        label = " (emulated speeds)" if self.emulated else ""
        records = self.run.read_metrics()
        evaluated = [r for r in records if r.get("eval_loss") is not None]
        loss_plot(
            self.run.loss_plot,
            [r["step"] for r in records],
            [r["loss"] for r in records],
            f"{self.run.path.name}: {self.model.name}, {plural(world, 'rank')}{label}",
            eval_steps=[r["step"] for r in evaluated],
            eval_losses=[r["eval_loss"] for r in evaluated],
        )
        summary = {
            "run_dir": str(self.run.path),
            "world_size": world,
            "emulated": self.emulated,
            "checkpoint": str(latest_checkpoint(self.run.checkpoints)),
            "ranks": [
                {
                    "rank": r.rank,
                    "replica": r.replica,
                    "stage": r.stage,
                    "group": r.group,
                    # None where this start ran no step (a restart that found the run done)
                    "optimizer_state_bytes": self.optimizer_state_bytes[r.rank]
                    if self.optimizer_state_bytes
                    else None,
                    "layers": [r.first_layer, r.first_layer + r.layers]
                    if len(r.chunks) == 1
                    else [[c.first_layer, c.first_layer + c.layers] for c in r.chunks],
                }
                for r in self.topology.ranks
            ],
        }
        if self.as_json:
            print(json.dumps(summary), flush=True)


def _with_idle(seconds: list[float], elapsed: float) -> dict[str, float]:
    """A stage's compute, communication and optimizer seconds as stage_times gives them, with
    its idle time against the step's ``elapsed``."""
    compute, comm, optimizer = seconds
    return {
        "compute_s": compute,
        "comm_s": comm,
        "optimizer_s": optimizer,
        "idle_s": max(0.0, elapsed - compute - comm - optimizer),
    }


def _tensorboard(run: RunDir):
    """A TensorBoard writer into RUN_DIR/tensorboard when tensorboard is installed, else None."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # optional: metrics.jsonl has every figure anyway
        return None
    return SummaryWriter(str(run.path / "tensorboard"))


def say(message: str) -> None:
    logger("train").info(message)
