"""One event of a step's timeline: what the predictor simulates and what the runtime measures,
in one shape, so that a trace can show the two one above the other (report.trace)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

OPERATION_KINDS = ("forward", "backward", "weight")
"""A timeline's name of each kind of operation a stage computes, indexed by spec.schedules'
FORWARD, BACKWARD and WEIGHT (a zero-bubble schedule's W; its backward is then B alone)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TimelineEvent:
    """One operation of one stage, in seconds from the step's start."""

    pipeline: int
    """The pipeline layout (index in the plan)."""
    stage: int
    group: str
    micro_batch: int | None = None
    """None for what spans the step (gradient sync, optimizer, the last sends' wait)."""
    kind: str
    """Predicted: forward, backward, weight (a zero-bubble schedule's W; its backward is then
    B), send, grad_sync, optimizer; measured: forward, backward, recv_wait, send_wait,
    grad_sync, optimizer (runtime.timeline)."""
    start_s: float
    end_s: float
    source: str | None = None
    """"predicted", "measured" or None (a prediction's own events): a trace's process name."""

    def to_dict(self) -> dict[str, Any]:
        """The event as prediction.json stores it: micro_batch and source only where set."""
        return {
            name: value
            for name, value in dataclasses.asdict(self).items()
            if value is not None or name not in ("micro_batch", "source")
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TimelineEvent:
        return cls(**data)
