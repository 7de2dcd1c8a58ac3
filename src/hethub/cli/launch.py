"""Starting a prepared job's workers on this machine through torchrun, and watching them."""

from __future__ import annotations

import os
import subprocess
import sys

from hethub.cli.jobs import Job, plan_devices
from hethub.report.text import plural


def launch(job: Job, *, as_json: bool) -> int:
    """Start the job's workers on this machine through torchrun; its exit status."""
    world = plan_devices(job.plan)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        "-m",
        "hethub",
        "train",
        "--worker-of",
        str(job.run.path),
    ]
    command += ["--json"] if as_json else []
    command += ["--resume", str(job.run.path)] if job.resume_from is not None else []
    # One thread per rank (the engine sets it too); saying so spares torchrun's warning banner.
    code = subprocess.run(
        command, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"}
    ).returncode
    if code:
        print(
            f"hethub: error: a worker failed and torchrun stopped the {plural(world, 'worker')} "
            f"(exit {code}); "
            f"the failing worker's message is above",
            file=sys.stderr,
        )
    return code
