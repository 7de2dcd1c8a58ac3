"""`hethub launch`: the Slurm heterogeneous job and the per-host scripts it writes from a cluster
and a plan (their components, rendezvous, signal and requeue lines, read from the text; `bash -n`
on every script), its one-line refusals, and the per-host scripts run for real on this machine:
two torchrun agents, one per group, with the losses of the single-node run bit for bit."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hethub.cli import main
from hethub.errors import SpecError
from hethub.spec import parse_cluster
from tests.test_nodes import PLAN, environment, losses, run_agents

# local-hetero's two groups as two kinds of node, each with its slurm: section
LOCAL_KINDS = """groups:
  - name: fast
    accelerator: cpu
    nodes: 1
    devices_per_node: 1
    speed: 1.0
    slurm: {partition: big-cpu, constraint: epyc, account: lab, time: "2:00:00", cpus_per_node: 8}
  - name: slow
    accelerator: cpu
    nodes: 1
    devices_per_node: 1
    speed: 0.5
    slurm: {partition: small-cpu, time: "1-00:00:00"}
"""
LOCAL_PLAN = """model: tiny-llama
global_batch: 4
micro_batch: 1
precision: fp32
pipelines:
  - count: 1
    micro_batches: 4
    stages:
      - {group: fast, tp: 1, layers: 5}
      - {group: slow, tp: 1, layers: 3}
"""
# Two GPU kinds: group a's node runs a TP-2 stage on 2 devices, b's one stage on 1 (test_nodes).
GPU_KINDS = """groups:
  - {name: a, accelerator: a100-80gb, nodes: 1, devices_per_node: 2, hosts: [HOST]}
  - {name: b, accelerator: mi250x, nodes: 1, devices_per_node: 1, hosts: [elsewhere.invalid]}
"""


def launch(folder: Path, form: str, cluster: str, plan: str, *flags: str) -> int:
    (folder / "cluster.yaml").write_text(cluster)
    (folder / "plan.yaml").write_text(plan)
    return main(
        [
            *("launch", form),
            *("--cluster", str(folder / "cluster.yaml"), "--plan", str(folder / "plan.yaml")),
            *("--run-dir", str(folder / "runs" / "r"), "--out", str(folder / "out"), *flags),
        ]
    )


def components(script: str) -> list[dict[str, str]]:
    """The #SBATCH options of each component of a batch script, in order."""
    found: list[dict[str, str]] = [{}]
    for line in script.splitlines():
        if line == "#SBATCH hetjob":
            found.append({})
        elif line.startswith("#SBATCH --"):
            key, _, value = line.removeprefix("#SBATCH --").partition("=")
            found[-1][key] = value
    return found


def bash_n(path: Path) -> None:
    checked = subprocess.run(["bash", "-n", str(path)], check=False, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


def test_the_job_of_two_node_kinds_has_a_component_per_group(tmp_path):
    assert launch(tmp_path, "slurm", LOCAL_KINDS, LOCAL_PLAN, "--signal-seconds", "300") == 0
    script = (tmp_path / "out" / "job.sbatch").read_text()
    fast, slow = components(script)
    common = {"job-name": "hethub-r", "nodes": "1", "ntasks-per-node": "1"}
    common |= {"signal": "TERM@300", "requeue": ""}
    own = {"cpus-per-task": "8", "partition": "big-cpu", "constraint": "epyc", "account": "lab"}
    assert fast == common | own | {"time": "2:00:00"}
    assert slow == common | {"cpus-per-task": "1", "partition": "small-cpu", "time": "1-00:00:00"}
    assert (
        'RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_0" | head -n1)'
    ) in script
    sruns = [line for line in script.splitlines() if line.startswith("srun")]
    assert len(sruns) == 2
    for index, (group, srun) in enumerate(zip(("fast", "slow"), sruns)):
        assert srun.startswith(f"srun --het-group={index} --ntasks-per-node=1 bash -c ")
        assert f'--this-node={group}:"$SLURM_NODEID"' in srun
        assert "--nnodes=2 --nproc-per-node=1 " in srun
        assert '--rdzv-endpoint="$RDZV_ENDPOINT"' in srun and "--max-restarts=3" in srun
    assert f"RUN_DIR={tmp_path / 'runs' / 'r'}" in script
    assert 'START=(--resume "$RUN_DIR")' in script
    bash_n(tmp_path / "out" / "job.sbatch")


def test_gpu_groups_ask_for_their_devices_and_a_host_script_per_node(tmp_path):
    cluster = GPU_KINDS.replace("HOST", "gpu-host-0")
    assert launch(tmp_path, "slurm", cluster, PLAN, "--time", "30", "--partition", "gpu") == 0
    a, b = components((tmp_path / "out" / "job.sbatch").read_text())
    assert (a["gpus-per-node"], a["cpus-per-task"], a["nodelist"]) == ("2", "2", "gpu-host-0")
    assert (b["gpus-per-node"], b["partition"], b["time"]) == ("1", "gpu", "30")
    assert launch(tmp_path, "hosts", cluster, PLAN) == 0
    scripts = sorted((tmp_path / "out").glob("*.sh"))
    assert [s.name for s in scripts] == ["a-0.sh", "b-0.sh"]
    for script, (node, processes) in zip(scripts, (("a:0", 2), ("b:0", 1))):
        text = script.read_text()
        assert re.findall(r"--this-node=(\S+)", text) == [node]
        assert f"--nproc-per-node={processes} " in text
        assert "--rdzv-endpoint=gpu-host-0:29500" in text  # the first group's first host
        bash_n(script)


@pytest.mark.parametrize(
    "form, cluster, plan, flags, message",
    [
        (
            "slurm",
            LOCAL_KINDS.replace(', time: "1-00:00:00"', ""),
            LOCAL_PLAN,
            (),
            "group slow: no Slurm time limit: give 'time' in its slurm: section",
        ),
        (
            "slurm",
            LOCAL_KINDS,
            LOCAL_PLAN,
            ("--signal-seconds", "7200"),
            "group fast: --signal-seconds = 7200 is not below its time limit 2:00:00 (7200 s)",
        ),
        (
            "slurm",
            LOCAL_KINDS.replace('time: "2:00:00"', 'time: "2 hours"'),
            LOCAL_PLAN,
            (),
            "groups[0].slurm.time = '2 hours': must be a Slurm time limit",
        ),
        (
            "slurm",
            LOCAL_KINDS.replace("partition: small-cpu", "queue: small-cpu"),
            LOCAL_PLAN,
            (),
            "groups[1].slurm",
        ),
        (
            "slurm",
            LOCAL_KINDS,
            LOCAL_PLAN.replace("{group: slow, tp: 1", "{group: slow, tp: 2"),
            (),
            "slow",
        ),
        ("slurm", LOCAL_KINDS, LOCAL_PLAN, ("--run-dir", ""), "--run-dir is needed"),
        (
            "hosts",
            LOCAL_KINDS,
            LOCAL_PLAN,
            (),
            "no address for the rendezvous on node fast:0: give --rendezvous HOST",
        ),
    ],
)
def test_what_cannot_be_launched_is_one_line_and_exit_2(
    tmp_path, capsys, form, cluster, plan, flags, message
):
    assert launch(tmp_path, form, cluster, plan, *flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("hethub launch: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_slurm_section_fields_are_parsed_strictly():
    group = parse_cluster(
        {"groups": [{"name": "g", "accelerator": "h100", "devices_per_node": 8, "slurm": {}}]}
    ).groups[0]
    assert group.slurm is not None and group.slurm.time is None
    for time, ok in (
        ("90", True),
        ("1:30", True),
        ("2-12", True),
        ("0", False),
        ("1:2:3:4", False),
    ):
        data = {"name": "g", "accelerator": "h100", "devices_per_node": 8, "slurm": {"time": time}}
        try:
            parse_cluster({"groups": [data]})
            parsed = True
        except SpecError:
            parsed = False
        assert parsed == ok, time


@pytest.mark.slow
def test_the_per_host_scripts_train_the_single_node_losses_bit_for_bit(tmp_path):
    cluster = GPU_KINDS.replace("HOST", json.dumps(socket.gethostname()))
    (tmp_path / "cluster.yaml").write_text(cluster)
    (tmp_path / "plan.yaml").write_text(PLAN)
    one = subprocess.run(
        [sys.executable, "-m", "hethub", "train", "--cluster", "cluster.yaml", "--plan",
         "plan.yaml", "--run-dir", "runs/one", "--json", "--steps", "2", "--timeout", "60"],
        cwd=tmp_path, env=environment(), capture_output=True, text=True, timeout=180,
        check=False,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr

    def scripts_at(port: int) -> list[list[str]]:
        flags = ["--rendezvous", "127.0.0.1", "--port", str(port), "--python", sys.executable]
        flags += ["--steps", "2", "--timeout", "60", "--json"]
        assert launch(tmp_path, "hosts", cluster, PLAN, *flags) == 0
        return [["bash", str(tmp_path / "out" / name)] for name in ("a-0.sh", "b-0.sh")]

    (a, a_out, a_err), (b, _, b_err) = run_agents(tmp_path, scripts_at, 180)
    assert a == 0 and b == 0, a_err + b_err
    assert losses(a_out) == losses(one.stdout) and len(losses(a_out)) == 2
