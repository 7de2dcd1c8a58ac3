"""The learning rate of each optimizer step: a linear warm-up, then a cosine or linear decay to a
floor at the run's last step, or a constant rate (Megatron-LM's ``--lr-decay-style``,
torchtitan's ``lr_scheduler``).

A pure function of the step and the run's settings, so a resumed run (under any plan) takes the
same rate at each step as an uninterrupted one, and nothing about it needs saving in a
checkpoint. Not spec.schedules, which orders a pipeline's forwards and backwards.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Protocol


class LrSchedule(StrEnum):
    """How the rate moves after the warm-up."""

    COSINE = "cosine"
    """Half a cosine from the peak rate down to the floor."""
    LINEAR = "linear"
    """A straight line from the peak rate down to the floor."""
    CONSTANT = "constant"
    """The peak rate to the end."""


WARMUP_SHARE = 0.05
"""The share of a run's steps its warm-up takes when none is given."""
MIN_LR_SHARE = 0.1
"""The floor of a decay, as a share of the peak rate, when none is given."""


class Recipe(Protocol):
    """What the rate depends on (runtime.rundir.RunSettings has it)."""

    lr: float
    steps: int
    lr_schedule: str
    warmup_steps: int | None
    min_lr: float | None


def default_warmup_steps(steps: int) -> int:
    """The warm-up of a run of ``steps`` steps given none: WARMUP_SHARE of them, rounded."""
    return round(WARMUP_SHARE * steps)


def default_min_lr(lr: float) -> float:
    """The floor of a decay from ``lr`` given none: MIN_LR_SHARE of it."""
    return MIN_LR_SHARE * lr


def lr_at(step: int, recipe: Recipe) -> float:
    """The rate of optimizer step ``step`` (0-based): step s < W of a W-step warm-up takes
    (s + 1) / W of the peak (none takes 0, which would waste a step); after it the rate decays
    from the peak to the floor, which the run's last step (``steps - 1``) takes, or stays (a
    run whose last step is its first after the warm-up keeps the peak)."""
    peak = recipe.lr
    warmup = (
        recipe.warmup_steps
        if recipe.warmup_steps is not None
        else default_warmup_steps(recipe.steps)
    )
    if step < warmup:
        return peak * (step + 1) / warmup
    schedule = LrSchedule(recipe.lr_schedule)
    if schedule is LrSchedule.CONSTANT:
        return peak
    floor = recipe.min_lr if recipe.min_lr is not None else default_min_lr(peak)
    decay_steps = recipe.steps - 1 - warmup
    # no step after the warm-up but the last: nothing to decay over, the peak
    done = min(1.0, (step - warmup) / decay_steps) if decay_steps > 0 else 0.0
    if schedule is LrSchedule.COSINE:
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * done))
    return peak - (peak - floor) * done
