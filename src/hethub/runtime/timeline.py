"""A rank's measured step timeline: its recording (StepTimeline) and what it adds up to
(compute, communication and idle time).

The engine records, per step, events of kind forward, backward (compute, the layer's TP
collectives and any emulated slowdown included), recv_wait (blocked in a receive from the
neighbouring stage: the peer's compute still to come plus the transfer, which a receive cannot
tell apart, so it counts as idle), send_wait (waiting for the last sends to complete),
grad_sync (gradient all-reduce and loss reduction) and optimizer.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from hethub.report.timeline import TimelineEvent
from hethub.spec.topology import RankInfo

COMPUTE = ("forward", "backward")
COMMUNICATION = ("send_wait", "grad_sync")
IDLE = ("recv_wait",)


class StepTimeline:
    """The events of this rank's current step, in seconds from its start."""

    def __init__(self, me: RankInfo) -> None:
        self.me = me
        self.events: list[TimelineEvent] = []
        self._start = time.perf_counter()

    def start(self) -> None:
        """A new step starts now: its events replace the last step's."""
        self._start, self.events = time.perf_counter(), []

    @contextmanager
    def timed(
        self, kind: str, micro_batch: int | None = None, stretch: float = 0.0
    ) -> Iterator[None]:
        """Record the enclosed work as one event; with ``stretch``, first sleep ``stretch`` times
        its measured duration (an emulated slowdown, inside the event)."""
        start = time.perf_counter()
        yield
        if stretch:
            time.sleep(stretch * (time.perf_counter() - start))
        self.events.append(
            TimelineEvent(
                pipeline=self.me.pipeline,
                stage=self.me.stage,
                group=self.me.group,
                micro_batch=micro_batch,
                kind=kind,
                start_s=start - self._start,
                end_s=time.perf_counter() - self._start,
                source="measured",
            )
        )


def stage_times(events: list[TimelineEvent], iteration_s: float) -> dict[str, float]:
    """Seconds of the step this rank spent computing, communicating, idle and in the optimizer;
    idle also holds whatever the events do not cover (the time before its first operation)."""

    def total(kinds: tuple[str, ...]) -> float:
        return sum(e.end_s - e.start_s for e in events if e.kind in kinds)

    compute, comm, optimizer = total(COMPUTE), total(COMMUNICATION), total(("optimizer",))
    return {
        "compute_s": compute,
        "comm_s": comm,
        "optimizer_s": optimizer,
        "idle_s": max(0.0, iteration_s - compute - comm - optimizer),
    }
