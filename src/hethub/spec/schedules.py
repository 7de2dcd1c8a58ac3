"""The order in which one pipeline stage runs its micro-batches: the schedules' definition,
shared by the predictor (which simulates it) and the runtime (which runs it)."""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence

FORWARD, BACKWARD = 0, 1


class Schedule(enum.StrEnum):
    """A plan's pipeline schedule; its value is how plan files spell it."""

    ONE_F_ONE_B = "1f1b"
    """Each stage alternates one forward and one backward once its pipeline is full."""
    GPIPE = "gpipe"
    """Every forward, then every backward."""
    INTERLEAVED_1F1B = "interleaved-1f1b"
    """1F1B over ``virtual_stages`` chunks per stage (interleaved_sequence); a pipeline of one
    chunk per stage runs plain 1F1B."""


def stage_sequence(
    schedule: Schedule, stage: int, stages: int, micro_batches: int
) -> list[tuple[int, int]]:
    """The (kind, micro-batch) operations one stage runs, in order."""
    m = micro_batches
    if schedule == Schedule.GPIPE:
        return [(FORWARD, j) for j in range(m)] + [(BACKWARD, j) for j in range(m)]
    warmup = min(stages - stage - 1, m)
    sequence = [(FORWARD, j) for j in range(warmup)]
    for j in range(m - warmup):  # steady state: one forward, one backward
        sequence += [(FORWARD, warmup + j), (BACKWARD, j)]
    sequence += [(BACKWARD, j) for j in range(m - warmup, m)]  # cool-down
    return sequence


@functools.lru_cache(maxsize=65536)
def in_flight_micro_batches(
    schedule: Schedule,
    position: int,
    stages: int,
    micro_batches: int,
    chunks: tuple[int, ...] = (1,),
) -> float:
    """Micro-batches of the whole stage's activations the stage at ``position`` holds at its
    peak: peak_in_flight's walk of its order, read in closed form where a test proves the two
    equal (one chunk: 1F1B keeps stages - position, GPipe every micro-batch; equal chunks over
    whole groups of stages: megatron_in_flight), as a planner asks this a lot. ``chunks``: the
    stage's layers per chunk."""
    if len(chunks) == 1:
        if schedule == Schedule.GPIPE:
            return micro_batches
        return min(stages - position, micro_batches)
    whole_groups = micro_batches % stages == 0 and len(set(chunks)) == 1
    if schedule == Schedule.INTERLEAVED_1F1B and whole_groups:
        return megatron_in_flight(position, stages, micro_batches, len(chunks))
    return peak_in_flight(schedule, position, stages, micro_batches, chunks)


def megatron_in_flight(position: int, stages: int, micro_batches: int, chunks: int) -> float:
    """Micro-batches in flight at the peak of the stage at ``position`` under interleaved 1F1B
    with ``chunks`` equal chunks, were its warm-up Megatron-LM's 2 (p - s - 1) + (v - 1) p chunk
    forwards: peak_in_flight's exactly where the micro-batches fill whole groups of stages (no
    warm-up grows there), never more where the last group is short (interleaved_orders
    lengthens a warm-up there). Cheap where building the order is not."""
    warmup = 2 * (stages - position - 1) + (chunks - 1) * stages
    return min(warmup + 1, micro_batches * chunks) / chunks


@functools.lru_cache(maxsize=65536)
def peak_in_flight(
    schedule: Schedule, position: int, stages: int, micro_batches: int, chunks: tuple[int, ...]
) -> float:
    """Micro-batches of the whole stage's activations the stage at ``position`` holds at its
    peak, by walking its order (chunk_sequence): a forward of chunk c holds its layers'
    activations until its backward, so the peak of the chunks' layers in flight, over the
    stage's layers, is fractional where the chunks differ or are not all in flight."""
    held = peak = 0
    for kind, c, _ in chunk_sequence(schedule, position, stages, len(chunks), micro_batches):
        held += chunks[c] if kind == FORWARD else -chunks[c]
        peak = max(peak, held)
    whole, layers = divmod(peak, sum(chunks))
    return whole if not layers else peak / sum(chunks)


def chunk_sequence(
    schedule: Schedule, stage: int, stages: int, chunks: int, micro_batches: int
) -> list[tuple[int, int, int]]:
    """The (kind, chunk, micro-batch) operations one stage runs, in order, under any schedule:
    what the runtime runs and the predictor simulates. Only interleaved 1F1B has more than one
    chunk per stage (the plan refuses the others)."""
    if schedule == Schedule.INTERLEAVED_1F1B:
        return interleaved_sequence(stage, stages, chunks, micro_batches)
    if chunks != 1:
        raise ValueError(f"schedule {schedule} runs one chunk per stage, not {chunks}")
    return [(kind, 0, j) for kind, j in stage_sequence(schedule, stage, stages, micro_batches)]


def interleaved_sequence(
    stage: int, stages: int, chunks: int, micro_batches: int
) -> list[tuple[int, int, int]]:
    """Interleaved 1F1B (Megatron-LM's virtual pipeline): the (kind, chunk, micro-batch)
    operations of ``stage`` of ``stages``, which holds ``chunks`` chunks of layers: its chunk c
    is the model's chunk c x stages + stage, so a micro-batch passes every stage ``chunks`` times
    and the pipeline's bubble shrinks about ``chunks``-fold. With chunks = 1, plain 1F1B."""
    return list(interleaved_orders(stages, chunks, micro_batches)[stage])


@functools.cache
def interleaved_orders(
    stages: int, chunks: int, micro_batches: int
) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """Every stage's interleaved 1F1B order (see interleaved_sequence).

    Forwards go in groups of ``stages`` micro-batches, chunk by chunk inside a group
    (micro-batches 0..p-1 through chunk 0, then through chunk 1, ...), the last group taking what
    is left, so any micro-batch count runs (Megatron-LM's schedule table since 2023); backwards
    go in the same order with the chunks reversed. A stage runs some forwards first (warm-up),
    then alternates one forward and one backward, then runs the backwards left. Megatron-LM's
    warm-up, 2 (p - stage - 1) + (v - 1) p forwards, deadlocks when the last group is short
    (p = 8, v = 2, m = 10): a stage waits for a backward whose forwards come after it in its own
    order. So the warm-ups start there and grow, stage by stage, while the whole pipeline,
    run in dependency order with sends that never block (the runtime's isend), gets stuck: a
    longer warm-up only moves forwards earlier, and all forwards first (GPipe) never deadlocks.
    """
    p, v, m = stages, chunks, micro_batches
    order = []  # (chunk, micro-batch) in the forward order
    for first in range(0, m, p):
        group = range(first, min(first + p, m))
        order += [(c, j) for c in range(v) for j in group]
    forwards = [(FORWARD, c, j) for c, j in order]
    backwards = [(BACKWARD, v - 1 - c, j) for c, j in order]

    def sequence(warmup: int) -> tuple[tuple[int, int, int], ...]:
        steady = [op for k in range(m * v - warmup) for op in (forwards[warmup + k], backwards[k])]
        return tuple(forwards[:warmup] + steady + backwards[m * v - warmup :])

    if v == 1:
        warmups = [min(p - s - 1, m) for s in range(p)]
    else:
        warmups = [min(2 * (p - s - 1) + (v - 1) * p, m * v) for s in range(p)]
    while True:
        orders = tuple(sequence(w) for w in warmups)
        stopped = run_in_dependency_order(orders, p, v, m)
        stuck = [
            s
            for s in range(p)
            if stopped[s] < len(orders[s]) and orders[s][stopped[s]][0] == BACKWARD
        ]
        if not stuck:
            return orders
        for s in stuck:  # all forwards first (m v) cannot be stuck on a backward
            warmups[s] = min(warmups[s] + 1, m * v)


def run_in_dependency_order(
    orders: Sequence[Sequence[tuple[int, int, int]]],
    stages: int,
    chunks: int,
    micro_batches: int,
    ran: list[tuple[int, int, int, int]] | None = None,
) -> list[int]:
    """Run every stage's order (of (kind, chunk, micro-batch) operations) as a whole pipeline
    runs it, sends never blocking (the runtime's isend): stage after stage, each as far as its
    next operation's inputs allow (a forward waits for the previous model chunk's forward of its
    micro-batch; a backward for its own forward and the next chunk's backward), until nothing
    can run. Each operation run is appended to ``ran``, if given, as (stage, kind, chunk,
    micro-batch): an order where every dependency comes first. Returns where each stage
    stopped (the length of its order when it ran everything)."""
    p, v, m = stages, chunks, micro_batches
    last = p * v - 1
    done = bytearray(2 * p * v * m)  # (kind, model chunk, micro-batch) -> ran
    position = [0] * p
    progress = True
    while progress:
        progress = False
        for s, order in enumerate(orders):
            at, end = position[s], len(order)
            while at < end:
                kind, chunk, j = order[at]
                g = chunk * p + s
                if kind == FORWARD:
                    ready = g == 0 or done[(g - 1) * m + j]
                else:
                    ready = done[g * m + j] and (g == last or done[(p * v + g + 1) * m + j])
                if not ready:
                    break
                done[(kind * p * v + g) * m + j] = 1
                if ran is not None:
                    ran.append((s, kind, chunk, j))
                at += 1
            if at != position[s]:
                position[s], progress = at, True
    return position
