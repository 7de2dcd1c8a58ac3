"""One rank's training loop (Trainer): its engine built, the checkpoint resumed, then each step
trained, agreed on by every rank (the bytes moved, a non-finite loss, a signal to stop, the
step's time), logged on rank 0, checkpointed when due, and the run's end gathered once."""

from __future__ import annotations

import datetime
import math
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from hethub.comm import BRIDGE, NATIVE, local_device, peak_memory_bytes
from hethub.corpus import Corpus
from hethub.errors import HethubError
from hethub.report.terminal import plural
from hethub.runtime.checkpoint import load_checkpoint, save_checkpoint
from hethub.runtime.checkpoint_folders import (
    latest_checkpoint,
    latest_intact_checkpoint,
    remove_debris,
)
from hethub.runtime.engine import Engine
from hethub.runtime.lr_schedule import lr_at
from hethub.runtime.rundir import RunDir, RunSettings
from hethub.runtime.step_log import Agreed, StepLog, say, trace_leaders
from hethub.runtime.supervision import (
    LAUNCHED_BY_HETHUB,
    STOPPED,
    StopRequest,
)
from hethub.runtime.timeline import stage_times
from hethub.spec.cluster import ClusterSpec
from hethub.spec.model import ModelSpec
from hethub.spec.plan import Plan
from hethub.spec.topology import Topology

DATA_POSITION = "data_position"
"""A checkpoint's meta.json field: the sequences of the data the run had consumed (Corpus.batch's
``first`` of the next step)."""


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


def _agree_on_step(
    engine: Engine, stop, device, leader_slots: dict[int, int], own_before: tuple[int, int]
) -> Agreed:
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
    return Agreed(
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
            chosen[0] = latest_intact_checkpoint(run.checkpoints, say)
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


@dataclass(frozen=True, slots=True)
class TrainingJob:
    """What a worker trains: the run folder and its settings, the cluster, the plan, the model,
    the plan's ranks on the cluster and the corpus."""

    run: RunDir
    settings: RunSettings
    cluster: ClusterSpec
    plan: Plan
    model: ModelSpec
    topology: Topology
    corpus: Corpus


class Trainer:
    """One rank's steps, from the first (or the checkpoint it resumes) to the run's last: its
    engine, where it is in the data, rank 0's StepLog, and what one step hands the next (the
    bytes moved so far, the last step saved)."""

    def __init__(self, job: TrainingJob, stop: StopRequest, *, as_json: bool) -> None:
        self.job, self.stop = job, stop
        settings, cluster, topology = job.settings, job.cluster, job.topology
        self.rank = dist.get_rank()
        # Each rank on its node's accelerator of its group's kind, by LOCAL_RANK, else the CPU.
        self.device = local_device(
            topology.vendors(cluster)[self.rank], int(os.environ["LOCAL_RANK"])
        )
        self.engine = Engine.for_job(
            job.plan,
            topology,
            job.model,
            cluster,
            seed=settings.seed,
            lr=settings.lr,
            weight_decay=settings.weight_decay,
            clip_grad=settings.clip_grad,
            track_grad_norm=True,
            device=self.device,
            timeout=datetime.timedelta(seconds=settings.timeout_s),
            speed=cluster.group(topology.ranks[self.rank].group).speed,
        )
        self.evaluation = _Evaluation(settings, job.model, job.plan.global_batch)
        self.log = (
            StepLog(job.run, job.plan, job.model, cluster, topology, as_json)
            if self.rank == 0
            else None
        )
        self.leader_slots = {r.rank: i for i, r in enumerate(trace_leaders(topology))}
        self.start = self.position = self.saved = 0
        self.moved_before = torch.zeros(2, dtype=torch.float64)
        self.own_before = (0, 0)

    def train(self, *, resume: bool, restarted: bool) -> int:
        """Resume where asked, then train to the run's last step: the exit status (0, 1 for a
        non-finite loss under the user's torchrun, 128 + N when signal N stopped it)."""
        self._resume(resume, restarted)
        for step in range(self.start, self.job.settings.steps):
            code = self._step(step)
            if code is not None:
                return code
        return self._finish()

    def _resume(self, resume: bool, restarted: bool) -> None:
        """Collective: the checkpoint resumed (if any), or the HuggingFace weights to start
        from; where the run is in its data."""
        job, engine = self.job, self.engine
        if self.rank == 0:  # no save runs yet: what crashed saves left can go
            remove_debris(job.run.checkpoints)
        # hethub train verified the checkpoints before it started the workers; after a
        # restart, or under the user's torchrun, nobody has.
        verified = LAUNCHED_BY_HETHUB in os.environ and not restarted
        checkpoint = _checkpoint_to_resume(job.run, verified) if (resume or restarted) else None
        resumed = load_checkpoint(engine, checkpoint) if checkpoint else {"step": 0}
        self.start = self.saved = resumed["step"]
        # Where the run is in its data: the sequences it has consumed. Kept in each checkpoint,
        # so a resume under another plan, or another global batch, goes on with the very next
        # window; a checkpoint from before it was kept had consumed a global batch a step.
        self.position = resumed.get(DATA_POSITION, self.start * job.plan.global_batch)
        if checkpoint is None and job.settings.init_from:
            from hethub.runtime.hf_checkpoint import load_hf_weights  # transformers' formats

            load_hf_weights(engine, Path(job.settings.init_from))
        if self.log and (resume or restarted):
            job.run.keep_metrics_until(self.start)  # the steps after the checkpoint run again
            if restarted and LAUNCHED_BY_HETHUB not in os.environ:  # else hethub train says it
                say(f"workers restarted: resuming from step {self.start}")
        self.own_before = (engine.comm.bytes[NATIVE], engine.comm.bytes[BRIDGE])

    def _step(self, step: int) -> int | None:
        """Collective: step ``step`` (0-based) trained, agreed on, logged and checkpointed when
        due; the exit status where the run stops here, else None."""
        job, engine, settings = self.job, self.engine, self.job.settings
        plan, log = job.plan, self.log
        # A checkpoint is never written of non-finite weights: on a step that writes one, the
        # engine reads whether they are finite with the step's loss, in its one read a step.
        due = (step + 1) % settings.checkpoint_every == 0 or step + 1 == settings.steps
        lr = lr_at(step, settings)
        batch = job.corpus.batch(self.position, plan.global_batch, job.model.seq_len, settings.seed)
        loss = engine.step(batch, lr=lr, check_weights=due)
        self.position += plan.global_batch
        eval_loss = self.evaluation.after(step + 1, engine)
        agreed = _agree_on_step(engine, self.stop, self.device, self.leader_slots, self.own_before)
        self.own_before = (engine.comm.bytes[NATIVE], engine.comm.bytes[BRIDGE])
        stop_signal = 0 if step + 1 == settings.steps else agreed.stop_signal  # done: it ends
        if log:
            moved = agreed.moved - self.moved_before
            log.step(step + 1, settings.steps, loss, agreed, moved, lr=lr,
                     grad_norm=engine.grad_norm, eval_loss=eval_loss)  # fmt: skip
        self.moved_before = agreed.moved
        if agreed.non_finite or not math.isfinite(loss):
            return self._stopped_non_finite(step + 1, loss, agreed)
        if due or stop_signal:
            # A stop between checkpoints did not check the weights with its step: it does now.
            finite = not agreed.weights_non_finite if due else _weights_finite(engine)
            if not finite:
                return self._stopped_non_finite(step + 1, loss, None)
            meta = {"plan": plan.to_dict(), DATA_POSITION: self.position}
            save_checkpoint(
                engine, job.run.checkpoints, step + 1, meta, keep=settings.keep_checkpoints
            )
            self.saved = step + 1
        every = settings.trace_every
        if every > 0 and (step + 1) % every == 0 and step + 1 < settings.steps:
            _trace_so_far(engine, self.leader_slots, job.topology.world_size, step + 1, log)
        return self._stopped(step + 1, stop_signal) if stop_signal else None

    def _stopped(self, step: int, stop_signal: int) -> int:
        """A signal asked the run to stop: it did after step ``step``, its checkpoint written."""
        if self.log:
            self.log.close()
            if LAUNCHED_BY_HETHUB not in os.environ:  # hethub train says it otherwise
                name = signal.Signals(stop_signal).name
                say(
                    f"stopped by {name} after step {step}, checkpoint written; "
                    f"resume with: hethub train --resume {self.job.run.path}"
                )
        return 128 + stop_signal

    def _stopped_non_finite(self, step: int, loss: float, agreed: Agreed | None) -> int:
        """A loss (or, at a checkpoint, a weight) went non-finite: training on would write NaN
        checkpoints. Every rank stops here; the run keeps its last finite checkpoint.
        ``agreed``: the step's figures, where a loss went non-finite on some ranks (None: the
        weights)."""
        run, saved = self.job.run, self.saved
        if self.log:
            self.log.close()
            where = "its weights"
            if agreed is not None and agreed.non_finite:
                where = self.job.topology.ranks[agreed.first_non_finite].describe()
                if agreed.non_finite > 1:
                    where += f" and {plural(agreed.non_finite - 1, 'other rank')}"
            kept = f"its last checkpoint, step {saved}, is finite" if saved else "no checkpoint"
            say(
                f"error: the loss is {loss} at step {step} (non-finite on {where}): the run "
                f"stopped before writing a checkpoint of it ({kept}); train again with a lower "
                f"--lr"
            )
            run.write_json(run.path / STOPPED, {"reason": "non-finite loss", "step": step})
        # Under hethub train every rank exits 0, or torchrun would restart them into the same
        # NaN; hethub train finds stopped.json and exits 1. Under the user's torchrun: a failure.
        return 0 if LAUNCHED_BY_HETHUB in os.environ else 1

    def _finish(self) -> int:
        """Collective, after the last step: the trace's timelines and each rank's optimizer
        state, gathered once (and the trace leaders' timelines every --trace-every steps,
        _trace_so_far): a gather of every rank's objects each step would grow with the job."""
        world, steps = self.job.topology.world_size, self.job.settings.steps
        engine = self.engine
        gathered = [None] * world if self.rank == 0 else None
        dist.gather_object((engine.timeline, engine.optimizer.state_bytes()), gathered, dst=0)
        if self.log:
            self.log.optimizer_state_bytes = [state for _, state in gathered]
            last = steps if self.start < steps else None  # None: this start ran none
            self.log.finish([timeline for timeline, _ in gathered], world, last)
        return 0
