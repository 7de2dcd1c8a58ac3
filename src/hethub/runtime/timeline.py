"""What a rank's measured step timeline adds up to: compute, communication and idle time.

The engine records, per step, events of kind forward, backward (compute, the layer's TP
collectives and any emulated slowdown included), recv_wait (blocked in a receive from the
neighbouring stage: the peer's compute still to come plus the transfer, which a receive cannot
tell apart, so it counts as idle), send_wait (waiting for the last sends to complete),
grad_sync (gradient all-reduce and loss reduction) and optimizer.
"""

from __future__ import annotations

from hethub.report.timeline import TimelineEvent

COMPUTE = ("forward", "backward")
COMMUNICATION = ("send_wait", "grad_sync")
IDLE = ("recv_wait",)


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
