"""A rank's measured step timeline: its recording (StepTimeline) and what it adds up to
(compute, communication and idle time).

The engine records, per step, events of kind forward, backward (compute, the layer's TP
collectives and any emulated slowdown included), recv_wait (blocked in a receive from the
neighbouring stage: the peer's compute still to come plus the transfer, which a receive cannot
tell apart, so it counts as idle), send_wait (waiting for the last sends to complete),
grad_sync (gradient sync) and optimizer.

One clock times a step: on an accelerator its events (torch.Event, recorded in the device's
queue and read when the step is over, so timing never makes the host wait for the device), on
the CPU the host's clock, where the work is done when the call returns.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch

from hethub.report.timeline import TimelineEvent
from hethub.spec.topology import RankInfo

COMPUTE = ("forward", "backward")
COMMUNICATION = ("send_wait", "grad_sync")
IDLE = ("recv_wait",)


class HostClock:
    """The CPU's clock: a mark is the moment, read at once."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def wait(self, mark: float) -> None:
        """Until the work before ``mark`` is done: it is, on the CPU."""


class DeviceClock:
    """An accelerator's clock: a mark is an event in the device's queue, which the device
    stamps when it gets there; ``seconds`` reads two stamps, so ask it once the step is over."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> torch.Event:
        event = torch.Event(device=self.device, enable_timing=True)
        event.record()
        return event

    def seconds(self, start: torch.Event, end: torch.Event) -> float:
        return start.elapsed_time(end) / 1e3  # milliseconds

    def wait(self, mark: torch.Event) -> None:
        """Until the device has done the work queued before ``mark``."""
        mark.synchronize()


def step_clock(device: torch.device) -> HostClock | DeviceClock:
    """The clock of a step on ``device``: its events where it has them, else the host's."""
    return HostClock() if device.type == "cpu" else DeviceClock(device)


class _Span(NamedTuple):
    """One event as recorded: its clock's marks, read when the events are asked for."""

    kind: str
    micro_batch: int | None
    start: float | torch.Event
    end: float | torch.Event


class StepTimeline:
    """The events of this rank's current step, in seconds from its start."""

    def __init__(self, me: RankInfo, device: torch.device | None = None) -> None:
        """``device``: where the step runs (default: the CPU), whose clock times it."""
        self.me = me
        self.clock = step_clock(device or torch.device("cpu"))
        self._start = self.clock.mark()
        self._spans: list[_Span] = []

    def start(self) -> None:
        """A new step starts now: its events replace the last step's."""
        self._start, self._spans = self.clock.mark(), []

    @contextmanager
    def timed(
        self, kind: str, micro_batch: int | None = None, stretch: float = 0.0
    ) -> Iterator[None]:
        """Record the enclosed work as one event; with ``stretch``, first sleep ``stretch`` times
        its measured duration (an emulated slowdown, inside the event: on an accelerator this
        waits for the device to finish the work, an emulation's cost, never a real run's)."""
        start = self.clock.mark()
        yield
        if stretch:
            done = self.clock.mark()
            self.clock.wait(done)
            time.sleep(stretch * self.clock.seconds(start, done))
        self._spans.append(_Span(kind, micro_batch, start, self.clock.mark()))

    @property
    def events(self) -> list[TimelineEvent]:
        """The step's events: read from the clock's marks, once the step is over (on an
        accelerator, after the step's read of its results, when the device has stamped them)."""
        return [
            TimelineEvent(
                pipeline=self.me.pipeline,
                stage=self.me.stage,
                group=self.me.group,
                micro_batch=span.micro_batch,
                kind=span.kind,
                start_s=self.clock.seconds(self._start, span.start),
                end_s=self.clock.seconds(self._start, span.end),
                source="measured",
            )
            for span in self._spans
        ]


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
