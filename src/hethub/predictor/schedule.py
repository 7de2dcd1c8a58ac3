"""Event simulation of a pipeline schedule over non-uniform stages.

Each stage runs its operations (forward, backward or, under the zero-bubble schedules, the
weights' gradient W of one micro-batch) in the schedule's fixed order; an operation starts when
the stage's previous one has ended and its input has arrived (the forward from the stage before,
the backward from the stage after, each after its send; a W only its own backward, on its own
stage).
The order of operations is structure that depends only on (stages, micro-batches, schedule), so
it is built once and cached; simulating is then one pass over a flat list.

Every stage runs exactly one operation per position (its index in the stage's sequence), and an
operation waits only for operations at its own or the previous position. In the steady part of a
schedule the dependencies repeat with a short period, so once the end times of one position equal
those one period earlier plus a constant shift, every later position of that part repeats them
with the same shift (the step is a max-plus linear map, which commutes with adding a constant).
The simulation then jumps to the end of the steady part: exact, and a planner's inner loop no
longer pays for every micro-batch. Interleaved and zero-bubble orders are simulated whole.
"""

from __future__ import annotations

import contextlib
import gc
import math
from dataclasses import dataclass

from hethub.memo import memoized
from hethub.spec.schedules import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    Schedule,
    chunk_sequence,
    interleaved_orders,
    run_in_dependency_order,
    stage_model_chunks,
    stage_sequence,
)

__all__ = [
    "BACKWARD",
    "FORWARD",
    "WEIGHT",
    "ScheduleOrder",
    "collector_paused",
    "schedule_order",
    "simulate",
    "stage_end_times",
    "stage_sequence",
]


@dataclass(frozen=True, slots=True)
class ScheduleOrder:
    """The operations of all stages, in an order where every dependency comes first."""

    stages: int
    micro_batches: int
    ops: tuple[tuple[int, int, int], ...]
    """(stage, FORWARD|BACKWARD|WEIGHT, micro-batch) of each operation."""
    steps: tuple[tuple[int, int, int, int], ...]
    """Per operation: (index of the stage's previous op, index of the op it waits for,
    index of the send it waits for, index of its duration); -1 means none. Durations are
    indexed 3 x chunk + kind, over the model's chunks (chunk c of stage s is model chunk
    spec.schedules.model_chunk); sends by chunk boundary, the activations' first, then the
    gradients'."""
    last_op: tuple[int, ...]
    """Index of each stage's last operation."""
    periodic: tuple[tuple[int, int, int], ...]
    """(first, last, period): positions first..last whose dependencies repeat every ``period``."""

    chunks: int = 1
    """Chunks per stage (interleaved 1F1B, ZBV; else 1)."""
    last_gradient_op: tuple[int, ...] = ()
    """Per model chunk: the index of its last backward or W. A stage runs its operations one
    after another, so that one ends last of them: its end is when the chunk's gradients are
    final."""

    def chunk_of(self, i: int) -> int:
        """The model chunk operation ``i`` runs."""
        return self.steps[i][3] // len(KINDS)


@contextlib.contextmanager
def collector_paused():
    """Python's cycle collector off for one pure-Python build (and back as it was after), where
    much is allocated and nothing collectable: an order is tens of thousands of small tuples and
    lists, no cycles, and each collection they set off walks every order cached before. Scoped
    to one order's build, which calls no one else's code: a search, or a library user's process
    around it, keeps its collector."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


@memoized
def schedule_order(
    schedule: Schedule, stages: int, micro_batches: int, chunks: int = 1
) -> ScheduleOrder:
    """Build the dependency structure of a schedule once (_build_order)."""
    with collector_paused():
        return _build_order(schedule, stages, micro_batches, chunks)


def _build_order(
    schedule: Schedule, stages: int, micro_batches: int, chunks: int = 1
) -> ScheduleOrder:
    """Build the dependency structure of a schedule once.

    ``chunks`` > 1 (interleaved 1F1B, ZBV) or a zero-bubble schedule: _walked_order. One chunk
    per stage under interleaving is plain 1F1B, exactly, and is built as such.

    Ordering key: stages * position + (stage for forwards, stages - 1 - stage for backwards).
    A forward waits for the previous stage's forward at the same or an earlier position, a
    backward for the next stage's backward at the same or an earlier position, so the key puts
    every dependency first.
    """
    if chunks > 1 or Schedule(schedule).splits_backward:
        return _walked_order(Schedule(schedule), stages, chunks, micro_batches)
    if schedule == Schedule.INTERLEAVED_1F1B:
        schedule = Schedule.ONE_F_ONE_B
    # Sorted by (key, stage): the stages in turn, each into its key's bucket, in stage order.
    keys = stages * (2 * micro_batches + 1)
    buckets: list[list[tuple[int, int, int]]] = [[] for _ in range(keys)]
    for s in range(stages):
        for pos, (kind, j) in enumerate(stage_sequence(schedule, s, stages, micro_batches)):
            tie = s if kind == FORWARD else stages - 1 - s
            buckets[stages * pos + tie].append((s, kind, j))
    keyed = [op for bucket in buckets for op in bucket]
    # index[kind][stage][micro-batch]: each operation's place, known before any op waits for it
    index = [[[-1] * micro_batches for _ in range(stages)] for _ in (FORWARD, BACKWARD)]
    previous = [-1] * stages
    steps = []
    for i, (s, kind, j) in enumerate(keyed):
        index[kind][s][j] = i
        if kind == FORWARD and s > 0:
            dep, send = index[FORWARD][s - 1][j], s - 1  # activation sent over boundary s-1
        elif kind == BACKWARD and s < stages - 1:
            dep, send = index[BACKWARD][s + 1][j], (stages - 1) + s  # gradient over boundary s
        else:
            dep, send = -1, -1
        steps.append((previous[s], dep, send, len(KINDS) * s + kind))
        previous[s] = i
    last_op = tuple(previous)
    m, p = micro_batches, stages
    if (
        schedule == Schedule.GPIPE
    ):  # all forwards, then all backwards: each a run of identical positions
        periodic = ((1, m - 1, 1), (m + 1, 2 * m - 1, 1))
    else:  # 1F1B: every stage alternates forward and backward from position p-1 to 2m-p
        periodic = ((p - 1, 2 * m - p, 2),)
    return ScheduleOrder(
        stages,
        micro_batches,
        tuple(keyed),
        tuple(steps),
        last_op,
        periodic,
        last_gradient_op=last_op,  # one chunk a stage: its last operation is a backward
    )


def _walked_order(schedule: Schedule, p: int, v: int, m: int) -> ScheduleOrder:
    """The dependency structure of an order simulated whole (interleaved 1F1B, the zero-bubble
    schedules) over the model's p x v chunks: each stage's operations in the order
    spec.schedules gives them, in the order spec.schedules.run_in_dependency_order runs them.
    A forward of model chunk g waits for chunk g - 1's forward (sent over boundary g - 1, which
    under interleaving wraps from the last stage to the first between a stage's chunks, and
    under ZBV turns on the last stage: a send of no cost there); a backward for chunk g + 1's
    backward; a W for its own backward, on its own stage, which the stage's order puts first.
    No steady-state jump: the whole order is simulated (2 or 3 x m v p operations)."""
    if schedule == Schedule.INTERLEAVED_1F1B:
        orders = interleaved_orders(p, v, m)
    else:
        orders = tuple(tuple(chunk_sequence(schedule, s, p, v, m)) for s in range(p))
    ran: list[tuple[int, int, int, int]] = []
    stopped = run_in_dependency_order(orders, p, v, m, ran, schedule)
    if stopped != [len(order) for order in orders]:
        raise AssertionError(f"{schedule} order deadlocks (p={p}, v={v}, m={m})")
    last_chunk = p * v - 1
    held = stage_model_chunks(schedule, p, v)
    # index[kind][model chunk][micro-batch] of forwards and backwards
    index = [[[-1] * m for _ in range(last_chunk + 1)] for _ in (FORWARD, BACKWARD)]
    steps, previous = [], [-1] * p
    last_gradient = [-1] * (last_chunk + 1)
    for i, (s, kind, c, j) in enumerate(ran):
        g = held[s][c]
        if kind == FORWARD:
            index[FORWARD][g][j] = i
            # the activation over boundary g - 1
            dep, send = (index[FORWARD][g - 1][j], g - 1) if g > 0 else (-1, -1)
        else:
            last_gradient[g] = i
            if kind == BACKWARD:
                index[BACKWARD][g][j] = i
            if kind == BACKWARD and g < last_chunk:  # the gradient over boundary g
                dep, send = index[BACKWARD][g + 1][j], last_chunk + g
            else:
                dep, send = -1, -1
        steps.append((previous[s], dep, send, len(KINDS) * g + kind))
        previous[s] = i
    ops = tuple((s, kind, j) for s, kind, _, j in ran)
    return ScheduleOrder(
        p,
        m,
        ops,
        tuple(steps),
        tuple(previous),
        periodic=(),
        chunks=v,
        last_gradient_op=tuple(last_gradient),
    )


# Two positions repeat when their end times, less their first, agree to this share of one pass.
_REPEAT_TOLERANCE = 1e-9


KINDS = (FORWARD, BACKWARD, WEIGHT)
"""The kinds of operation, in the order a model chunk's durations are indexed."""


def durations_of(
    forward_s: list[float], backward_s: list[float], weight_s: list[float] | None
) -> list[float]:
    """Each model chunk's (forward, backward, W) times, flat, as ScheduleOrder.steps index
    them; no W (None) where the schedule does not split the backward."""
    durations = [0.0] * (len(KINDS) * len(forward_s))
    durations[FORWARD :: len(KINDS)] = forward_s
    durations[BACKWARD :: len(KINDS)] = backward_s
    if weight_s is not None:
        durations[WEIGHT :: len(KINDS)] = weight_s
    return durations


def simulate(
    order: ScheduleOrder,
    forward_s: list[float],
    backward_s: list[float],
    send_forward_s: list[float],
    send_backward_s: list[float],
    *,
    weight_s: list[float] | None = None,
    every_op: bool = False,
) -> list[float]:
    """End time of the operations of ``order`` (indexed like ``order.steps``).

    forward_s / backward_s / weight_s: per model chunk (per stage without interleaving), one
    micro-batch; under a zero-bubble schedule backward_s is B's (the input's gradient) and
    weight_s W's. send_*_s: per boundary between chunk b and b+1 (activations forward,
    gradients backward). The end times of each stage's last operation are always exact; those
    of operations inside a skipped steady run are left at 0 unless ``every_op`` asks for all
    of them (a timeline needs them).
    """
    durations = durations_of(forward_s, backward_s, weight_s)
    sends = [*send_forward_s, *send_backward_s, 0.0]  # index -1: no send
    end, _ = _run(order, durations, sends, every_op)
    return end


def stage_end_times(
    schedule: Schedule,
    forward_s: list[float],
    backward_s: list[float],
    send_forward_s: list[float],
    send_backward_s: list[float],
    micro_batches: int,
    *,
    chunks: int = 1,
    weight_s: list[float] | None = None,
) -> list[float]:
    """When each stage finishes its last operation: simulate() of the whole schedule, exactly.
    Costs as for simulate(); ``chunks`` per stage (interleaved 1F1B, ZBV) and the zero-bubble
    schedules are simulated whole.

    Once the steady state repeats, every cycle of c further micro-batches adds the same time to
    every stage. So a long schedule is simulated at a shorter length where its steady state shows,
    chosen so that the micro-batches left out are whole cycles, which are then added as time. If
    the steady state does not show, the full schedule is simulated.
    """
    p = len(forward_s) // chunks
    durations = durations_of(forward_s, backward_s, weight_s)
    sends = [*send_forward_s, *send_backward_s, 0.0]
    if chunks > 1 or Schedule(schedule).splits_backward:
        order = schedule_order(schedule, p, micro_batches, chunks)
        end, _ = _run(order, durations, sends, False)
        return [end[i] for i in order.last_op]
    # Leave out a multiple of 12 micro-batches, so that cycles of 1, 2, 3, 4, 6 or 12 need no
    # second probe; a second probe, cut to whole cycles, handles the rest.
    simulated = 2 * p + _STEADY_PROBE
    simulated += (micro_batches - simulated) % 12
    for _ in range(2 if micro_batches > 2 * simulated else 0):
        order = schedule_order(schedule, p, simulated)
        end, cycles = _run(order, durations, sends, False)
        left_out = micro_batches - simulated
        if len(cycles) == len(order.periodic) and all(
            left_out % length == 0 for _, length in cycles
        ):
            extra = sum(left_out // length * shift for shift, length in cycles)
            return [end[i] + extra for i in order.last_op]
        if len(cycles) != len(order.periodic):
            break
        simulated += left_out % math.lcm(*(length for _, length in cycles))
    order = schedule_order(schedule, p, micro_batches)
    end, _ = _run(order, durations, sends, False)
    return [end[i] for i in order.last_op]


# Micro-batches beyond twice the stages that a shortened simulation keeps to find the steady state.
_STEADY_PROBE = 24


def _run(order: ScheduleOrder, durations: list[float], sends: list[float], every_op: bool):
    """The simulation proper: end times, and (shift, micro-batches) of each steady cycle it jumped
    over."""
    p = order.stages
    steps = order.steps
    end = [0.0] * (len(steps) + 1)  # index -1: nothing to wait for, ends at 0
    runs = (
        []
        if every_op
        else [(first, last, period, {}) for first, last, period in order.periodic if last > first]
    )
    cycles: list[tuple[float, int]] = []
    grid = _REPEAT_TOLERANCE * (sum(durations) + sum(sends)) or 1.0
    position, positions = 0, len(steps) // p
    check_from = min((first for first, *_ in runs), default=positions)
    while position < positions:
        for i in range(position * p, (position + 1) * p):
            prev, dep, send, duration = steps[i]
            start = end[prev]
            ready = end[dep] + sends[send]
            if ready > start:  # noqa: PLR1730 - a call to max() costs a third of this hot loop
                start = ready
            end[i] = start + durations[duration]
        if position >= check_from and runs:
            position = _jump(end, position, p, runs, cycles, grid)
        position += 1
    end.pop()
    return end, cycles


def _jump(
    end: list[float],
    position: int,
    p: int,
    runs: list,
    cycles: list[tuple[float, int]],
    grid: float,
) -> int:
    """If the end times at ``position`` repeat those at an earlier position of the same steady run
    up to one shift (compared on a grid far coarser than rounding noise and far finer than any
    duration), jump ahead by as many whole cycles as the run still holds."""
    for index, (first, last, period, seen) in enumerate(runs):
        if not first <= position < last or (position - first) % period:  # cycles span whole periods
            continue
        now = end[position * p : (position + 1) * p]
        base = now[0]
        key = tuple(map(round, [(t - base) / grid for t in now]))
        earlier = seen.setdefault(key, position)
        if earlier == position:
            return position
        span = position - earlier
        cycles_left = (last - position) // span
        target = position + cycles_left * span
        shift = base - end[earlier * p]
        end[target * p : (target + 1) * p] = [t + cycles_left * shift for t in now]
        del runs[index]  # each steady run is jumped over once
        cycles.append((shift, span // period))
        return target
    return position
