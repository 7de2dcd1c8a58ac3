"""Ranks that share a machine's cores: the schedule simulated with each operation's speed set by
how many ranks compute at that moment.

A local run of more ranks than the machine has cores (4 ranks on 2 cores) is profiled with every
rank computing at once: the slowest case. But a pipeline's fill and drain, and every stage that
waits for its input, leave the machine to the ranks still computing, which then go faster (a
rank blocked in a receive takes no core). The max-plus simulation (predictor.schedule) fixes each
operation's duration; this one is a fluid simulation: between two events the set of computing
ranks is fixed, and every computing operation advances at the rate its time at that concurrency
gives.

That time is interpolated linearly in the ranks computing, between an operation's measured time
with its own ranks alone on the machine and its measured time with all of the job's ranks. Not
flat up to the core count, as ideal sharing would be: the scheduler does not spread runnable
ranks evenly over the cores at every moment, and the waiting ranks' communication threads take
their share, so the slowdown grows from the first rank computing beside another; the line
through the two measured ends follows it (docs/predictor.md, "More ranks than cores").

The mean rate is not all: ranks sharing cores get them in the scheduler's slices, so an
operation's time varies widely around its mean, and a pipeline waits for the later of two
varying operations at every dependency: its step is longer than one of mean operations. Where
the profile measured that spread (its layer_time_spread), the simulation is run for SAMPLES
draws of every operation's time around its mean (log-normal, variance spread x duration: the
longer an operation, the more slices it spans) and its times averaged.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from hethub.predictor.schedule import ScheduleOrder


@dataclass(frozen=True, slots=True)
class CoreSharing:
    """How a job's ranks share the cores of the one machine they all run on.

    The operations' durations given to simulate_shared are their times with all ``ranks``
    computing at once (as profiled); ``alone`` is an operation's time with only ``least`` ranks
    computing (one TP group of the plan's smallest degree, alone on the machine), as a share of
    that.
    """

    cores: int
    ranks: int
    least: int
    alone: float
    spread_s: float = 0.0
    """The variance of an operation's time over its mean, in seconds (the layer profile's
    layer_time_spread); 0: every operation takes its mean."""

    def slowdown(self, computing: int) -> float:
        """An operation's time with ``computing`` ranks computing, as a share of its time with all
        ``ranks`` computing: linear between ``least`` ranks (``alone``) and all of them (1)."""
        if computing <= self.least:
            return self.alone
        return self.alone + (1.0 - self.alone) * (computing - self.least) / (
            self.ranks - self.least
        )


@dataclass(frozen=True, slots=True)
class SharedLayout:
    """One pipeline layout as the shared simulation needs it."""

    order: ScheduleOrder
    forward_s: list[float]
    """Per model chunk (per stage, without interleaving), one micro-batch with every rank of the
    job computing (emulated stretch included)."""
    backward_s: list[float]
    """Per model chunk: its backward, or a zero-bubble schedule's B."""
    send_forward_s: list[float]
    """Per boundary: an activation forward."""
    send_backward_s: list[float]
    ranks: list[int]
    """Per stage: the ranks computing each of its operations (its replicas times its TP degree)."""
    speed: list[float]
    """Per stage: its emulated speed (1.0: none). The runtime stretches an operation by sleeping
    (1 / speed - 1) times as long as it computed, and a sleeping rank takes no core."""
    weight_s: Sequence[float] = ()
    """Per model chunk: a zero-bubble schedule's W (none under the others, which run no W)."""

    def mean_s(self, i: int) -> float:
        """Operation ``i``'s time with every rank of the job computing (its stretch left
        out)."""
        kind = self.order.ops[i][1]
        return (self.forward_s, self.backward_s, self.weight_s)[kind][self.order.chunk_of(i)]


# An operation is done when what is left of it is below this share of its work (rounding).
_DONE = 1e-9


SAMPLES = 32
"""Draws of the operations' times where they spread. For a 4-stage pipeline of 8 micro-batches
whose 20 ms operations vary by 30%, the spread adds 3.8% to the step over 1000 draws; 32 draws
price it 1.4% higher than 1000 (16: 1.9%, 64: 0.5%): always the same draws (seeded)."""


def simulate_shared(
    layouts: list[SharedLayout], sharing: CoreSharing
) -> list[tuple[list[float], list[float]]]:
    """(start, end) times of every operation of every layout (indexed like its order.steps),
    all layouts' ranks sharing the cores together: with the operations' times spread
    (sharing.spread_s), the mean over SAMPLES seeded draws (the same draws every call).

    Each stage runs its operations in its schedule's order; one starts when the stage's previous
    one has ended and its input has arrived (the dependency's end plus the send). A started
    operation computes (its ranks count as computing) and then, on an emulated stage, sleeps.
    """
    if sharing.spread_s <= 0:
        return _simulate_once(layouts, sharing, None)
    draws = random.Random(0)
    runs = [_simulate_once(layouts, sharing, draws) for _ in range(SAMPLES)]
    return [
        (
            [
                statistics.fmean(run[i][0][k] for run in runs)
                for k in range(len(layout.order.steps))
            ],
            [
                statistics.fmean(run[i][1][k] for run in runs)
                for k in range(len(layout.order.steps))
            ],
        )
        for i, layout in enumerate(layouts)
    ]


def _simulate_once(
    layouts: list[SharedLayout], sharing: CoreSharing, draws: random.Random | None
) -> list[tuple[list[float], list[float]]]:
    """One simulation; with ``draws``, each operation's work drawn around its mean."""
    times = [
        ([0.0] * len(layout.order.steps), [None] * len(layout.order.steps)) for layout in layouts
    ]
    stages = [
        _Stage(layout, s, *times[index], _factors(layout, draws, sharing.spread_s))
        for index, layout in enumerate(layouts)
        for s in range(layout.order.stages)
    ]
    now = 0.0
    while True:
        for stage in stages:  # an idle stage whose next input is known gets the time it can start
            if stage.phase == _IDLE and stage.next < len(stage.ops):
                stage.ready = stage.ready_time()
                if stage.ready is not None:
                    stage.phase = _WAITING
        computing = [s for s in stages if s.phase == _COMPUTING]
        rate = 1.0 / sharing.slowdown(sum(s.ranks for s in computing)) if computing else 0.0
        events = [s.ready for s in stages if s.phase == _WAITING]
        events += [s.sleep_until for s in stages if s.phase == _SLEEPING]
        events += [now + s.left / rate for s in computing]
        if not events:
            break
        later = max(min(events), now)
        for s in computing:
            s.left -= (later - now) * rate
        now = later
        for stage in stages:
            stage.advance(now)
    if any(end is None for _, ends in times for end in ends):
        raise AssertionError("shared simulation stalled: the schedule order has a dependency cycle")
    return times  # type: ignore[return-value]


_IDLE, _WAITING, _COMPUTING, _SLEEPING = range(4)


def _factors(
    layout: SharedLayout, draws: random.Random | None, spread_s: float
) -> list[float] | None:
    """Per operation of ``layout``, its work's multiple of its mean: log-normal with mean 1 and
    variance spread_s / mean work (None: every operation its mean)."""
    if draws is None:
        return None
    factors = []
    for i in range(len(layout.order.ops)):
        mean = layout.mean_s(i)
        sigma = math.sqrt(math.log1p(spread_s / mean)) if mean > 0 else 0.0
        factors.append(math.exp(draws.gauss(-sigma * sigma / 2, sigma)))
    return factors


class _Stage:
    """One stage's progress through its operations; writes their start and end times."""

    __slots__ = (
        "ends",
        "factors",
        "index",
        "layout",
        "left",
        "next",
        "ops",
        "phase",
        "ranks",
        "ready",
        "sends",
        "sleep_until",
        "starts",
    )

    def __init__(
        self,
        layout: SharedLayout,
        index: int,
        starts: list[float],
        ends: list[float | None],
        factors: list[float] | None = None,
    ) -> None:
        self.layout, self.index, self.starts, self.ends = layout, index, starts, ends
        self.factors = factors
        self.ops = [i for i, (s, _, _) in enumerate(layout.order.ops) if s == index]
        self.ranks = layout.ranks[index]
        self.sends = [
            *layout.send_forward_s,
            *layout.send_backward_s,
        ]  # indexed like order.steps' sends
        self.next, self.phase = 0, _IDLE
        self.ready: float | None = 0.0
        self.sleep_until = self.left = 0.0

    def work(self, i: int) -> float:
        """What operation ``i`` computes, in seconds with every rank computing (its stretch left
        out)."""
        duration = self.layout.mean_s(i)
        if self.factors is not None:
            duration *= self.factors[i]
        return duration * self.layout.speed[self.index]

    def ready_time(self) -> float | None:
        """When the next operation can start, or None while its input's producer has not ended."""
        prev, dep, send, _ = self.layout.order.steps[self.ops[self.next]]
        ready = self.ends[prev] if prev >= 0 else 0.0
        if dep >= 0:
            if self.ends[dep] is None:
                return None
            ready = max(ready, self.ends[dep] + self.sends[send])
        return ready

    def advance(self, now: float) -> None:
        """Start, stop computing or finish the current operation, as its times say at ``now``."""
        if self.next >= len(self.ops):
            return
        i = self.ops[self.next]
        if self.phase == _WAITING and self.ready <= now:
            self.phase, self.left, self.starts[i] = _COMPUTING, self.work(i), now
        elif self.phase == _COMPUTING and self.left <= _DONE * self.work(i):
            self.sleep_until = now + (1.0 / self.layout.speed[self.index] - 1.0) * (
                now - self.starts[i]
            )
            self.phase = _SLEEPING
        if self.phase == _SLEEPING and self.sleep_until <= now:
            self.ends[i] = now
            self.phase, self.next = _IDLE, self.next + 1
