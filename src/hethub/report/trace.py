"""Chrome trace files (open in https://ui.perfetto.dev or chrome://tracing) of step timelines.

A timeline is a list of TimelineEvents (report.timeline); their ``source`` ("predicted" or
"measured", None counting as predicted) lets two timelines be shown one above the other.
A trace file is written whole or not at all (hethub.files.write_atomic): a training run rewrites
it while it runs (--trace-every), and a reader opening it then sees the last one written.
"""

from __future__ import annotations

import json
from pathlib import Path

from hethub.files import write_atomic
from hethub.report.timeline import OPERATION_KINDS, TimelineEvent

COMPUTE_KINDS = OPERATION_KINDS
"""What a stage computes (its first row); the rest is communication (its second)."""


def chrome_trace(
    events: list[TimelineEvent], title: str = "hethub", *, step: int | None = None
) -> dict:
    """The trace as a JSON-ready object: one process per (source, pipeline), two rows per stage.
    ``step``: the training step whose measured timeline it shows, kept in its ``otherData``
    (None: a prediction alone, or no step)."""
    processes: dict[tuple[str, int], int] = {}
    rows: dict[tuple[int, int], str] = {}
    trace = []
    for event in events:
        source = event.source or "predicted"
        pid = processes.setdefault((source, event.pipeline), len(processes) + 1)
        compute = event.kind in COMPUTE_KINDS
        tid = 2 * event.stage + (0 if compute else 1)
        rows[(pid, tid)] = (
            f"stage {event.stage} · {event.group}"
            if compute
            else f"stage {event.stage} · communication"
        )
        label = event.kind if event.micro_batch is None else f"{event.kind} {event.micro_batch}"
        trace.append(
            {
                "name": label,
                "cat": event.kind,
                "ph": "X",
                "pid": pid,
                "tid": tid,
                "ts": event.start_s * 1e6,
                "dur": max(event.end_s - event.start_s, 0.0) * 1e6,
            }
        )
    for (source, pipeline), pid in processes.items():
        trace.append(
            {
                "name": "process_name",
                "ph": "M",
                "pid": pid,
                "args": {"name": f"{source} · pipeline {pipeline}"},
            }
        )
        trace.append(
            {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}
        )
    for (pid, tid), name in rows.items():
        trace.append(
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
        )
        trace.append(
            {
                "name": "thread_sort_index",
                "ph": "M",
                "pid": pid,
                "tid": tid,
                "args": {"sort_index": tid},
            }
        )
    other = {"title": title} if step is None else {"title": title, "step": step}
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": other}


def write_trace(
    path: Path, events: list[TimelineEvent], title: str = "hethub", *, step: int | None = None
) -> None:
    """Write the trace (chrome_trace) to ``path`` atomically: a reader sees the previous trace
    or this one whole, never half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(chrome_trace(events, title, step=step)))
