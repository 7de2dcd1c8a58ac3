"""One process of a training run under torchrun: its engine, the steps, the metrics, the
checkpoints, and (on rank 0) the run's records: metrics.jsonl, trace.json and loss.png.

It reads the plan and the cluster from the run directory that `hethub train` prepared; it never
plans. Rank 0 alone writes files and prints: one JSON object per step on stdout with --json,
progress on stderr.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

from hethub.comm import BRIDGE, NATIVE, local_device, peak_memory_bytes
from hethub.errors import HethubError
from hethub.report.plot import loss_plot
from hethub.report.terminal import progress_bar
from hethub.report.text import plural
from hethub.report.timeline import TimelineEvent
from hethub.report.trace import write_trace
from hethub.runtime.affinity import bind_rank
from hethub.runtime.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    remove_debris,
    save_checkpoint,
)
from hethub.runtime.data import global_batch
from hethub.runtime.engine import Engine
from hethub.runtime.rundir import RunDir, RunSettings
from hethub.runtime.timeline import stage_times
from hethub.runtime.topology import Topology
from hethub.spec.cluster import ClusterSpec
from hethub.spec.model import ModelSpec
from hethub.spec.plan import Plan


def train(
    run: RunDir,
    settings: RunSettings,
    cluster: ClusterSpec,
    plan: Plan,
    model: ModelSpec,
    topology: Topology,
    corpus: torch.Tensor,
    *,
    resume: bool,
    as_json: bool,
) -> int:
    """Train the run's plan from its start (or its latest checkpoint) to settings.steps."""
    world = int(os.environ["WORLD_SIZE"])
    if world != topology.world_size:
        raise HethubError(
            f"{run.plan}: the plan needs {plural(topology.world_size, 'process', 'processes')}, "
            f"torchrun started {world} "
            f"(give --nproc-per-node x nodes = {topology.world_size})"
        )
    torch.set_num_threads(1)
    bind_rank(int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=settings.timeout_s))
    try:
        rank = dist.get_rank()
        # Each rank on its node's accelerator of its group's kind, by LOCAL_RANK, else the CPU.
        device = local_device(topology.vendors(cluster)[rank], int(os.environ["LOCAL_RANK"]))
        engine = Engine.for_job(
            plan,
            topology,
            model,
            cluster,
            seed=settings.seed,
            lr=settings.lr,
            device=device,
            speed=cluster.group(topology.ranks[rank].group).speed,
        )
        if rank == 0:  # no save runs yet: what crashed saves left can go
            remove_debris(run.checkpoints)
        start = load_checkpoint(engine, latest_checkpoint(run.checkpoints))["step"] if resume else 0
        log = _StepLog(run, plan, model, cluster, topology, as_json) if rank == 0 else None
        if log and resume:
            run.keep_metrics_until(start)
        moved_before = torch.zeros(2, dtype=torch.float64)
        timelines: list = []
        for step in range(start, settings.steps):
            loss = engine.step(
                global_batch(corpus, step, plan.global_batch, model.seq_len, settings.seed)
            )
            moved = torch.tensor(
                [engine.comm.bytes[NATIVE], engine.comm.bytes[BRIDGE]], dtype=torch.float64
            )
            dist.all_reduce(moved)
            gathered = [None] * world if rank == 0 else None
            dist.gather_object((engine.timeline, peak_memory_bytes(device)), gathered, dst=0)
            if log:
                timelines = [timeline for timeline, _ in gathered]
                peaks = [peak for _, peak in gathered if peak is not None]
                peak = max(peaks) if peaks else None
                log.step(step + 1, settings.steps, loss, timelines, moved - moved_before, peak)
            moved_before = moved
            if (step + 1) % settings.checkpoint_every == 0 or step + 1 == settings.steps:
                save_checkpoint(
                    engine,
                    run.checkpoints,
                    step + 1,
                    {"plan": plan.to_dict()},
                    keep=settings.keep_checkpoints,
                )
        if log:
            log.finish(timelines, world)
    finally:
        dist.destroy_process_group()
    return 0


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
        self.bar = progress_bar()
        self.board = _tensorboard(run)
        # The stage leaders of each layout's first replica: the rows of the trace and the metrics.
        first = {}
        for r in topology.ranks:
            first.setdefault(r.pipeline, r.replica)
        self.leaders = [
            r for r in topology.ranks if r.tp_rank == 0 and first[r.pipeline] == r.replica
        ]

    def step(
        self,
        step: int,
        steps: int,
        loss: float,
        timelines: list[list[TimelineEvent]],
        moved: torch.Tensor,
        peak_memory: int | None,
    ) -> None:
        elapsed = max(e.end_s for events in timelines for e in events)
        predicted = self.prediction["iteration_time_s"] if self.prediction else None
        record = {
            "step": step,
            "loss": loss,
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
            "stages": [
                {
                    "pipeline": r.pipeline,
                    "replica": r.replica,
                    "stage": r.stage,
                    "group": r.group,
                    **stage_times(timelines[r.rank], elapsed),
                }
                for r in self.leaders
            ],
            "emulated": self.emulated,
            # The largest over the ranks of the device memory each held at its peak (None when
            # every rank runs on a CPU, where nothing counts it).
            "peak_memory_gb": peak_memory / 1e9 if peak_memory is not None else None,
        }
        self.run.append_metrics(record)
        if self.board:
            for name in ("loss", "tokens_per_s", "iteration_time_s", "model_tflops_per_device"):
                if record[name] is not None:
                    self.board.add_scalar(name, record[name], step)
        if self.as_json:
            print(json.dumps(record), flush=True)
        detail = (
            f"loss {loss:.4f} | {record['tokens_per_s']:,.0f} tokens/s | step {elapsed:.2f} s"
            + (f" (predicted {predicted:.2f} s)" if predicted else "")
            + (" | emulated speeds" if self.emulated else "")
        )
        if self.bar:
            self.bar.update("step", step, steps, detail)
        elif not self.as_json:  # a log: one line per step, for people and for grep
            print(f"step {step}/{steps}: {detail}", file=sys.stderr, flush=True)

    def finish(self, timelines: list[list[TimelineEvent]], world: int) -> None:
        if self.bar:
            self.bar.close()
        if self.board:
            self.board.close()
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
        write_trace(
            self.run.trace,
            events,
            f"hethub {self.run.path.name}: predicted and measured step{label}",
        )
        records = self.run.read_metrics()
        loss_plot(
            self.run.loss_plot,
            [r["step"] for r in records],
            [r["loss"] for r in records],
            f"{self.run.path.name}: {self.model.name}, {plural(world, 'rank')}{label}",
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
                    "layers": [r.first_layer, r.first_layer + r.layers],
                }
                for r in self.topology.ranks
            ],
        }
        if self.as_json:
            print(json.dumps(summary), flush=True)


def _tensorboard(run: RunDir):
    """A TensorBoard writer into RUN_DIR/tensorboard when tensorboard is installed, else None."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # optional: metrics.jsonl has every figure anyway
        return None
    return SummaryWriter(str(run.path / "tensorboard"))
