"""Run plans on this machine through `hethub validate` (profiles, prediction before the run, the
real run, the measured iteration): shared by predictor_vs_runtime.py and hetero_speedup.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml


def validate(
    workdir: Path, name: str, cluster: dict, plan: dict, steps: int, profiles: Path
) -> dict:
    """`hethub validate --json` of ``plan`` on ``cluster``; its final object."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / f"{name}.cluster.yaml").write_text(yaml.safe_dump(cluster, sort_keys=False))
    (workdir / f"{name}.yaml").write_text(yaml.safe_dump(plan, sort_keys=False))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hethub",
            "validate",
            "--cluster",
            f"{name}.cluster.yaml",
            "--plan",
            f"{name}.yaml",
            "--steps",
            str(steps),
            "--profiles",
            str(profiles.resolve()),
            "--json",
            "--run-dir",
            f"runs/{name}",
        ],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    # Exit 1 is validate's verdict (off by more than --tolerance) on a run that was measured: its
    # report is what is wanted here, however far off.
    if done.returncode not in (0, 1) or not done.stdout.strip():
        raise SystemExit(
            f"{name}: hethub validate failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
        )
    return json.loads(done.stdout.splitlines()[-1])


def stage(group: str, tp: int, layers: int | list[int]) -> dict:
    """A stage of a plan; ``layers``: its layers, or under interleaving its chunks' layers."""
    return {"group": group, "tp": tp, "layers": layers}
