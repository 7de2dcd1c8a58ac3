"""`hethub train --trace-every N`: trace.json is rewritten every N steps while the run goes on
(the measured timeline of the step just done, beside the predicted one), whole at every moment a
reader opens it; a run stopped by SIGTERM keeps the trace of its last multiple of N, and resumed
keeps --trace-every and ends with its last step's trace; a bad N is one line before any process
starts."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from test_long_runs import Training
from test_train_cli import CLUSTER, PLAN, hethub

EVERY = 2
ARGS = ["--cluster", "cluster.yaml", "--plan", "plan.yaml", "--timeout", "30"]
ARGS += ["--checkpoint-every", "1000", "--keep-checkpoints", "1"]  # a save only where it stops


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    (tmp_path / "plan.yaml").write_text(PLAN)
    return tmp_path


def measured_trace(path: Path) -> tuple[int, set[tuple[int, str]]]:
    """The step trace.json shows, and the (stage process, kind) of its measured events."""
    trace = json.loads(path.read_text())  # never half a file: written atomically
    names = {
        e["pid"]: e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    measured = {
        (e["tid"] // 2, e["cat"])
        for e in trace["traceEvents"]
        if e["ph"] == "X" and names[e["pid"]].startswith("measured")
    }
    return trace["otherData"]["step"], measured


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="Training finds the workers through /proc")
def test_trace_json_is_rewritten_every_n_steps_while_the_run_goes_on(folder):
    # Far more steps than the test waits for: trace.json can only be a periodic write's.
    with Training(
        folder, "runs/traced", *ARGS, "--steps", "400", "--trace-every", str(EVERY)
    ) as run:
        run.wait_for("trace.json", timeout=60)
        seen = []
        deadline = time.monotonic() + 60
        while len({step for step, _ in seen}) < 2:  # two writes at least, read mid-run
            assert run.process.poll() is None and time.monotonic() < deadline
            seen.append(measured_trace(folder / "runs/traced/trace.json"))
            time.sleep(0.05)
        run.process.send_signal(signal.SIGTERM)
        code, stderr = run.finish(timeout=60)
    assert code == 143, stderr
    for step, measured in seen:
        assert step % EVERY == 0 and 0 < step < 400
        # both stages' forward, backward and optimizer, measured
        assert {(s, k) for s in (0, 1) for k in ("forward", "backward", "optimizer")} <= measured
    # Stopped between writes: the trace is the last multiple of N it trained, not the end's.
    records = (folder / "runs/traced/metrics.jsonl").read_text().splitlines()
    last = json.loads(records[-1])["step"]
    assert measured_trace(folder / "runs/traced/trace.json")[0] == last - last % EVERY
    # Resumed without the flag, the run keeps it; a finished run ends with its last step's trace.
    resumed = hethub(folder, "train", "--resume", "runs/traced", "--steps", str(last + 1))
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((folder / "runs/traced/run.json").read_text())["trace_every"] == EVERY
    step, measured = measured_trace(folder / "runs/traced/trace.json")
    assert step == last + 1 and ("optimizer" in {kind for _, kind in measured})


@pytest.mark.parametrize("value", ["-1", "two"])
def test_a_bad_trace_every_is_one_line_before_any_process_starts(folder, value):
    done = hethub(folder, "train", *ARGS, "--trace-every", value, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"hethub train: error: --trace-every = {value}: must be an integer of 0 or more"
    ]
    assert not (folder / "runs").exists()
