"""Whether a run's steps take what was predicted: checked once, after the first steps, and said
once where they differ.

The first step after a (re)start warms up (allocations, first-touch pages, gloo's first
messages), so the check takes the median of the next COMPARED_STEPS steps' measured times. Where
it differs from the predicted step by more than TOLERANCE of the latter, one line on stderr names
the likely causes, from what prediction.json says of the profiles that priced the run
(hethub.profiles.provenance): measured on another machine or torch, under another load, or an
emulated speed; and the command that measures the profiles again. The finding goes into that
step's metrics.jsonl record either way (``prediction_check``).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from typing import Any

from hethub.messages import logger

WARM_UP_STEPS = 1
"""Steps after a (re)start left out: the first step warms up."""
COMPARED_STEPS = 3
"""Steps whose median is compared (steps 2 to 4 of a run)."""
TOLERANCE = 0.25
"""Measured and predicted differ when their difference is more than this share of the
prediction."""
LOAD_DIFFERENCE = 1.0
"""Load averages that differ by a core's worth of runnable processes or more were another
machine, as far as a CPU's times go."""


def _warn(message: str) -> None:
    logger().warning(f"warning: {message}")


class PredictionCheck:
    """Rank 0's check of its run's step times against prediction.json (None: no prediction)."""

    def __init__(
        self, prediction: dict[str, Any] | None, warn: Callable[[str], None] = _warn
    ) -> None:
        self.prediction, self.warn = prediction or {}, warn
        self.predicted_s: float | None = self.prediction.get("iteration_time_s")
        self.steps: list[tuple[int, float]] = []
        self.done = self.predicted_s is None

    def after_step(self, step: int, measured_s: float) -> dict[str, Any]:
        """The fields to add to ``step``'s metrics record: ``prediction_check`` on the step that
        completes the comparison (warning once where it fails), else none."""
        if self.done:
            return {}
        self.steps.append((step, measured_s))
        if len(self.steps) < WARM_UP_STEPS + COMPARED_STEPS:
            return {}
        self.done = True
        compared = self.steps[WARM_UP_STEPS:]
        median = statistics.median(t for _, t in compared)
        off = median / self.predicted_s - 1
        finding: dict[str, Any] = {
            "steps": [s for s, _ in compared],
            "measured_median_s": median,
            "predicted_s": self.predicted_s,
            "difference": off,
            "within_tolerance": abs(off) <= TOLERANCE,
        }
        if abs(off) > TOLERANCE:
            finding["causes"] = self.causes()
            finding["measure_again"] = (self.prediction.get("profiles") or {}).get("measure_again")
            self.warn(self.message(finding))
        return {"prediction_check": finding}

    def causes(self) -> list[str]:
        """The likely reasons, most telling first."""
        profiles = self.prediction.get("profiles")
        if not profiles:
            return [f"the prediction rests on {self.prediction.get('basis', 'no profiles')}"]
        found = []
        when = f"the profiles in {profiles['folder']} (measured {profiles.get('measured_at')})"
        if profiles.get("differences"):
            found.append(f"{when} are another machine's: {', '.join(profiles['differences'])}")
        then, now = profiles.get("load_at_measuring"), _load_average()
        if then is not None and now is not None and abs(now - then) >= LOAD_DIFFERENCE:
            found.append(f"the load average was {then:.1f} as they were measured, {now:.1f} now")
        if self.prediction.get("emulated"):
            found.append("emulated speeds (a group's compute stretched, not real hardware)")
        if not found:
            found.append(f"{when} are another moment's: the machine's load may have changed")
        return found

    def message(self, finding: dict[str, Any]) -> str:
        """The one line the check says."""
        first, last = finding["steps"][0], finding["steps"][-1]
        off = finding["difference"]
        line = (
            f"steps {first}-{last} took {finding['measured_median_s']:.2f} s (median), "
            f"{abs(off):.0%} {'over' if off > 0 else 'under'} the "
            f"{finding['predicted_s']:.2f} s predicted (more than {TOLERANCE:.0%}); likely: "
            + "; ".join(finding["causes"])
        )
        if finding.get("measure_again"):
            line += f"; measure again with: {finding['measure_again']}"
        return line


def _load_average() -> float | None:
    """The 1-minute load average now (None where the system has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None
