"""The order in which one pipeline stage runs its micro-batches: the schedules' definition,
shared by the predictor (which simulates it) and the runtime (which runs it)."""

from __future__ import annotations

import enum

FORWARD, BACKWARD = 0, 1


class Schedule(enum.StrEnum):
    """A plan's pipeline schedule; its value is how plan files spell it."""

    ONE_F_ONE_B = "1f1b"
    """Each stage alternates one forward and one backward once its pipeline is full."""
    GPIPE = "gpipe"
    """Every forward, then every backward."""


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
