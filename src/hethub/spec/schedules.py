"""The order in which one pipeline stage runs its micro-batches: the schedules' definition,
shared by the predictor (which simulates it) and the runtime (which runs it)."""

from __future__ import annotations

import enum
import functools

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
        stuck = _stuck_on_a_backward(orders, p, v)
        if not stuck:
            return orders
        for s in stuck:  # all forwards first (m v) cannot be stuck on a backward
            warmups[s] = min(warmups[s] + 1, m * v)


def _stuck_on_a_backward(orders, p: int, v: int) -> list[int]:
    """Run the stages' orders in dependency order (a forward waits for the previous model
    chunk's forward of its micro-batch; a backward for its own forward and the next chunk's
    backward); the stages left waiting for a backward when nothing can run (none: no deadlock)."""
    m = max(j for order in orders for _, _, j in order) + 1
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
                at += 1
            if at != position[s]:
                position[s], progress = at, True
    return [
        s
        for s in range(p)
        if position[s] < len(orders[s]) and orders[s][position[s]][0] == BACKWARD
    ]
