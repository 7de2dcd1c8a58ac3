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
import json
import math
import os
import signal
import sys
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from hethub.comm import BRIDGE, NATIVE, local_device, peak_memory_bytes
from hethub.corpus import Corpus, open_corpus
from hethub.errors import HethubError
from hethub.report.plot import loss_plot
from hethub.report.prediction_check import PredictionCheck
from hethub.report.terminal import progress_bar
from hethub.report.text import plural
from hethub.report.timeline import TimelineEvent
from hethub.report.trace import write_trace
from hethub.runtime.affinity import bind_rank
from hethub.runtime.checkpoint import load_checkpoint, save_checkpoint
from hethub.runtime.checkpoint_folders import (
    latest_checkpoint,
    latest_intact_checkpoint,
    remove_debris,
)
from hethub.runtime.engine import Engine
from hethub.runtime.lr_schedule import lr_at
from hethub.runtime.rundir import RunDir, RunSettings
from hethub.runtime.supervision import (
    LAUNCHED_BY_HETHUB,
    STOPPED,
    Heartbeat,
    StopRequest,
    die_with_parent,
    init_process_group,
)
from hethub.runtime.timeline import stage_times
from hethub.runtime.torch_support import require_supported_torch
from hethub.spec import load_cluster, load_model, load_plan
from hethub.spec.cluster import ClusterSpec
from hethub.spec.model import ModelSpec
from hethub.spec.plan import Plan
from hethub.spec.topology import Topology, build_topology


def train(
    run: RunDir,
    settings: RunSettings,
    cluster: ClusterSpec,
    plan: Plan,
    model: ModelSpec,
    topology: Topology,
    corpus: Corpus,
    *,
    resume: bool,
    as_json: bool,
    rank: int | None = None,
) -> int:
    """Train the run's plan from its start (or its latest checkpoint) to settings.steps, as
    ``rank`` of the plan (None: torchrun's RANK); the exit status: 0, 1 when the loss went
    non-finite, 128 + N when signal N stopped it."""
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
        return _train_steps(
            run, settings, cluster, plan, model, topology, corpus, stop, resume, restarted, as_json
        )
    except RuntimeError:  # dist.DistError is one: a collective that failed or timed out
        if _lost_peers(heartbeat, topology, stop, settings.timeout_s):
            return 1
        raise  # nobody is missing: a fault of this rank's own, with its traceback
    finally:
        heartbeat.close()
        with contextlib.suppress(RuntimeError):  # a group whose peers are gone
            dist.destroy_process_group()


DATA_POSITION = "data_position"
"""A checkpoint's meta.json field: the sequences of the data the run had consumed (Corpus.batch's
``first`` of the next step)."""

HEARTBEAT_S = 0.5
"""How often a rank says it is alive (hethub.runtime.supervision.Heartbeat): a silent rank is
named within a few beats of --timeout."""


def _train_steps(
    run, settings, cluster, plan, model, topology, corpus, stop, resume, restarted, as_json
) -> int:
    rank = dist.get_rank()
    world = topology.world_size
    # Each rank on its node's accelerator of its group's kind, by LOCAL_RANK, else the CPU.
    device = local_device(topology.vendors(cluster)[rank], int(os.environ["LOCAL_RANK"]))
    engine = Engine.for_job(
        plan,
        topology,
        model,
        cluster,
        seed=settings.seed,
        lr=settings.lr,
        weight_decay=settings.weight_decay,
        clip_grad=settings.clip_grad,
        track_grad_norm=True,
        device=device,
        timeout=datetime.timedelta(seconds=settings.timeout_s),
        speed=cluster.group(topology.ranks[rank].group).speed,
    )
    if rank == 0:  # no save runs yet: what crashed saves left can go
        remove_debris(run.checkpoints)
    # hethub train verified the checkpoints before it started the workers; after a restart, or
    # under the user's torchrun, nobody has.
    verified = LAUNCHED_BY_HETHUB in os.environ and not restarted
    checkpoint = _checkpoint_to_resume(run, verified) if (resume or restarted) else None
    resumed = load_checkpoint(engine, checkpoint) if checkpoint else {"step": 0}
    start = resumed["step"]
    # Where the run is in its data: the sequences it has consumed. Kept in each checkpoint, so a
    # resume under another plan, or another global batch, goes on with the very next window;
    # a checkpoint from before it was kept had consumed a global batch a step.
    position = resumed.get(DATA_POSITION, start * plan.global_batch)
    if checkpoint is None and settings.init_from:
        from hethub.runtime.hf_checkpoint import load_hf_weights  # transformers' formats

        load_hf_weights(engine, Path(settings.init_from))
    evaluation = _Evaluation(settings, model, plan.global_batch)
    log = _StepLog(run, plan, model, cluster, topology, as_json) if rank == 0 else None
    if log and (resume or restarted):
        run.keep_metrics_until(start)  # the steps after the checkpoint run again
        if restarted and LAUNCHED_BY_HETHUB not in os.environ:  # hethub train says it otherwise
            _say(f"workers restarted: resuming from step {start}")
    moved_before = torch.zeros(2, dtype=torch.float64)
    leader_slots = {r.rank: i for i, r in enumerate(trace_leaders(topology))}
    own_before = (engine.comm.bytes[NATIVE], engine.comm.bytes[BRIDGE])  # this rank's, so far
    saved = start
    for step in range(start, settings.steps):
        # A checkpoint is never written of non-finite weights: on a step that writes one, the
        # engine reads whether they are finite with the step's loss, in its one read a step.
        due = (step + 1) % settings.checkpoint_every == 0 or step + 1 == settings.steps
        lr = lr_at(step, settings)
        loss = engine.step(
            corpus.batch(position, plan.global_batch, model.seq_len, settings.seed),
            lr=lr,
            check_weights=due,
        )
        position += plan.global_batch
        eval_loss = evaluation.after(step + 1, engine)
        agreed = _agree_on_step(engine, stop, device, leader_slots, own_before)
        own_before = (engine.comm.bytes[NATIVE], engine.comm.bytes[BRIDGE])
        stop_signal = 0 if step + 1 == settings.steps else agreed.stop_signal  # done: it ends
        if log:
            log.step(
                step + 1,
                settings.steps,
                loss,
                agreed,
                agreed.moved - moved_before,
                lr=lr,
                grad_norm=engine.grad_norm,
                eval_loss=eval_loss,
            )
        moved_before = agreed.moved
        if agreed.non_finite or not math.isfinite(loss):
            return _stopped_non_finite(run, topology, step + 1, loss, agreed, saved, log)
        if due or stop_signal:
            # A stop between checkpoints did not check the weights with its step: it does now.
            finite = not agreed.weights_non_finite if due else _weights_finite(engine)
            if not finite:
                return _stopped_non_finite(run, topology, step + 1, loss, None, saved, log)
            save_checkpoint(
                engine,
                run.checkpoints,
                step + 1,
                {"plan": plan.to_dict(), DATA_POSITION: position},
                keep=settings.keep_checkpoints,
            )
            saved = step + 1
        every = settings.trace_every
        if every > 0 and (step + 1) % every == 0 and step + 1 < settings.steps:
            _trace_so_far(engine, leader_slots, world, step + 1, log)
        if stop_signal:
            if log:
                log.close()
            if log and LAUNCHED_BY_HETHUB not in os.environ:  # hethub train says it otherwise
                name = signal.Signals(stop_signal).name
                _say(
                    f"stopped by {name} after step {step + 1}, checkpoint written; "
                    f"resume with: hethub train --resume {run.path}"
                )
            return 128 + stop_signal
    # The trace's timelines and each rank's optimizer state, gathered once, at the end (and the
    # trace leaders' timelines every --trace-every steps, _trace_so_far): a gather of every
    # rank's objects each step would grow with the job.
    gathered = [None] * world if rank == 0 else None
    dist.gather_object((engine.timeline, engine.optimizer.state_bytes()), gathered, dst=0)
    if log:
        log.optimizer_state_bytes = [state for _, state in gathered]
        last = settings.steps if start < settings.steps else None  # None: this start ran none
        log.finish([timeline for timeline, _ in gathered], world, last)
    return 0


def _trace_so_far(engine: Engine, leader_slots: dict[int, int], world: int, step: int, log):
    """Collective, every --trace-every steps: rank 0 rewrites trace.json with the step just done
    (``step``, 1-based), so that a long run's trace can be looked at while it runs.

    It writes that one step, not the --trace-every steps since the last write: the trace sets a
    measured step beside the predicted one, as the final trace does, and metrics.jsonl has the
    steps in between. Nothing piles up between writes either: engine.timeline holds the current
    step's events alone (StepTimeline.start drops the last step's), and only the trace leaders
    (a stage count) send theirs, so every write costs what the first did, however long the run.
    One gather_object, as at the end: the timelines never travel on the steps that write none."""
    gathered = [None] * world if engine.rank == 0 else None
    own = engine.timeline if engine.rank in leader_slots else None
    dist.gather_object(own, gathered, dst=0)
    if log:
        log.write_trace(gathered, step)


class _Evaluation:
    """The run's validation: --eval-data's first windows, in document order, evaluated under
    the run's own plan (Engine.evaluate) every --eval-every steps and after the last."""

    def __init__(self, settings: RunSettings, model: ModelSpec, global_batch: int) -> None:
        self.every = settings.eval_every or settings.checkpoint_every
        self.steps = settings.steps
        self.tokens: torch.Tensor | None = None  # (n, seq_len + 1), read once
        if settings.eval_data is not None:
            from hethub.corpus import open_corpus  # the corpus API: torch and numpy

            corpus = open_corpus(settings.eval_data, what="--eval-data")
            count = settings.eval_sequences or global_batch
            self.tokens = corpus.consecutive(0, count, model.seq_len)

    def after(self, step: int, engine: Engine) -> float | None:
        """Collective: the validation loss after step ``step`` (1-based) where one is due, else
        None."""
        if self.tokens is None or not (step % self.every == 0 or step == self.steps):
            return None
        return engine.evaluate(self.tokens)


def trace_leaders(topology: Topology) -> list:
    """The stage leaders of each layout's first replica: the rows of the trace and of each
    step's per-stage times (a stage's count, not the rank count)."""
    first: dict[int, int] = {}
    for r in topology.ranks:
        first.setdefault(r.pipeline, r.replica)
    return [r for r in topology.ranks if r.tp_rank == 0 and first[r.pipeline] == r.replica]


class _Agreed(NamedTuple):
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


def _agree_on_step(
    engine: Engine, stop, device, leader_slots: dict[int, int], own_before: tuple[int, int]
) -> _Agreed:
    """Collective, after a step: two all-reduces of a few numbers (of host values: the step has
    read the device already), a SUM and a MAX, whose size depends on the plan's stages, never
    on the rank count: the bytes moved, the non-finite losses and weights, the signal to stop
    (so that all stop after the same step), the step's time and peak memory, and the trace
    leaders' per-stage times, and the busiest rank's bytes (``own_before``: this rank's bytes
    per path before the step)."""
    rank, world = engine.rank, engine.comm.world_size
    own_non_finite = not math.isfinite(engine.own_loss)
    sums = torch.zeros(4 + 3 * len(leader_slots), dtype=torch.float64)
    sums[0], sums[1] = engine.comm.bytes[NATIVE], engine.comm.bytes[BRIDGE]
    sums[2], sums[3] = own_non_finite, engine.weights_finite is False
    events = engine.timeline
    elapsed = max((e.end_s for e in events), default=0.0)
    slot = leader_slots.get(rank)
    if slot is not None:
        times = stage_times(events, elapsed)
        sums[4 + 3 * slot : 7 + 3 * slot] = torch.tensor(
            [times["compute_s"], times["comm_s"], times["optimizer_s"]], dtype=torch.float64
        )
    peak = peak_memory_bytes(device)
    # A MAX of the negated rank finds the lowest rank with a non-finite loss.
    own = [engine.comm.bytes[NATIVE] - own_before[0], engine.comm.bytes[BRIDGE] - own_before[1]]
    maxes = torch.tensor(
        [
            stop.signal or 0,
            elapsed,
            -1 if peak is None else peak,
            -(rank if own_non_finite else world),
            *own,
        ],
        dtype=torch.float64,
    )
    dist.all_reduce(sums)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    return _Agreed(
        moved=sums[:2].clone(),
        stop_signal=int(maxes[0]),
        non_finite=int(sums[2]),
        first_non_finite=int(-maxes[3]),
        weights_non_finite=sums[3].item() > 0,
        elapsed=maxes[1].item(),
        peak_memory=None if maxes[2] < 0 else int(maxes[2]),
        stage_seconds=sums[4:].reshape(-1, 3),
        busiest=(int(maxes[4]), int(maxes[5])),
    )


def _checkpoint_to_resume(run: RunDir, verified: bool) -> Path | None:
    """Collective: the checkpoint every rank resumes from. Unless the host that started the job
    has ``verified`` it, rank 0 takes the newest intact one, moving damaged newer ones aside with
    a line each (every rank checksumming the same files would read them world-size times)."""
    if verified:
        return latest_checkpoint(run.checkpoints)
    chosen: list = [None, None]  # the checkpoint, or the line that says there is none intact
    if dist.get_rank() == 0:
        try:
            chosen[0] = latest_intact_checkpoint(run.checkpoints, _say)
        except HethubError as error:
            chosen[1] = str(error)
    dist.broadcast_object_list(chosen, src=0)
    if chosen[1] is not None:
        raise HethubError(chosen[1])
    return chosen[0]


def _weights_finite(engine: Engine) -> bool:
    """Collective: every rank's weights are finite (a read of the device outside the steps)."""
    finite = torch.tensor([float(engine.weights_are_finite())])
    dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    return bool(finite.item())


def _stopped_non_finite(run, topology, step, loss, agreed: _Agreed | None, saved, log) -> int:
    """A loss (or, at a checkpoint, a weight) went non-finite: training on would write NaN
    checkpoints. Every rank stops here; the run keeps its last finite checkpoint. ``agreed``:
    the step's figures, where a loss went non-finite on some ranks (None: the weights)."""
    if log:
        log.close()
        where = "its weights"
        if agreed is not None and agreed.non_finite:
            where = topology.ranks[agreed.first_non_finite].describe()
            if agreed.non_finite > 1:
                where += f" and {plural(agreed.non_finite - 1, 'other rank')}"
        kept = f"its last checkpoint, step {saved}, is finite" if saved else "no checkpoint"
        _say(
            f"error: the loss is {loss} at step {step} (non-finite on {where}): the run "
            f"stopped before writing a checkpoint of it ({kept}); train again with a lower --lr"
        )
        run.write_json(run.path / STOPPED, {"reason": "non-finite loss", "step": step})
    # Under hethub train every rank exits 0, or torchrun would restart them into the same NaN;
    # hethub train finds stopped.json and exits 1. Under the user's torchrun: a failure.
    return 0 if LAUNCHED_BY_HETHUB in os.environ else 1


def _lost_peers(heartbeat: Heartbeat, topology: Topology, stop, timeout_s: float) -> bool:
    """After a failed collective: whether peers went missing (or the agent is stopping the
    workers), naming, once for the whole job, the ranks that stopped answering."""
    silent = heartbeat.silent_ranks()
    # Ranks whose process ended: the agent reports their exit; the survivors only follow.
    gone = [r for r in silent if heartbeat.alive_here(r) is False]
    hung = [r for r in silent if r not in gone]
    if hung and heartbeat.first_to_report():
        _say(
            f"error: {', '.join(topology.ranks[r].describe() for r in hung)} did not answer "
            f"within --timeout {timeout_s:g} s (stopped, hung or cut off); stopping the workers"
        )
        heartbeat.stop_silent_local_peers(hung)
    return bool(silent) or stop.signal is not None


def _say(message: str) -> None:
    print(f"hethub train: {message}", file=sys.stderr, flush=True)


class _StepLog:
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
        agreed: _Agreed,
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
            print(f"step {step}/{steps}: {detail}", file=sys.stderr, flush=True)

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
    corpus = open_corpus(settings.data)
    topology = build_topology(plan, cluster)
    return train(
        run,
        settings,
        cluster,
        plan,
        model,
        topology,
        corpus,
        resume=resume,
        as_json=as_json,
        rank=rank,
    )


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
    print(f"hethub train: error: {error}", file=sys.stderr, flush=True)
    return 2


if __name__ == "__main__":
    main()
