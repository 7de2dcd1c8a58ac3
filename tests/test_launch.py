"""`hethub launch`: the Slurm heterogeneous job and the per-host scripts it writes from a cluster
and a plan (their components, rendezvous, signal and requeue lines, read from the text; `bash -n`
on every script), its one-line refusals, and the per-host scripts run for real on this machine:
two torchrun agents, one per group, with the losses of the single-node run bit for bit."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from pydoc_data.topics import topics

import pytest
import yaml

from hethub.cli import main
from hethub.errors import SpecError
from hethub.runtime.spawn import rendezvous_store
from hethub.spec import parse_cluster
from hethub.spec.cluster import slurm_time_seconds
from hethub.spec.plan import parse_plan
from tests.test_nodes import PLAN, TIMEOUT_S, WIDE_CLUSTER, WIDE_PLAN, environment

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


def real(folder: Path) -> tuple[str, ...]:
    """The flags a launch on real accelerators needs beside the plan (it trains no default corpus
    or length): a corpus of the standard library's pydoc texts, written as a text file."""
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(topics.values()))
    return ("--data", str(corpus), "--steps", "10")


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
    assert 'export RDZV_ENDPOINT="${RDZV_ADDR:-$RDZV_HOST}:29500"' in script
    # one rendezvous per start of the job: a requeued job keeps its id, not its count
    assert 'export RDZV_ID="hethub-$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}"' in script
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
    flags = ("--time", "30", "--partition", "gpu", *real(tmp_path))
    assert launch(tmp_path, "slurm", cluster, PLAN, *flags) == 0
    a, b = components((tmp_path / "out" / "job.sbatch").read_text())
    assert (a["gpus-per-node"], a["cpus-per-task"], a["nodelist"]) == ("2", "2", "gpu-host-0")
    assert (b["gpus-per-node"], b["partition"], b["time"]) == ("1", "gpu", "30")
    assert launch(tmp_path, "hosts", cluster, PLAN, *real(tmp_path)) == 0
    scripts = sorted((tmp_path / "out").glob("*.sh"))
    assert [s.name for s in scripts] == ["a-0.sh", "b-0.sh"]
    for script, (node, processes) in zip(scripts, (("a:0", 2), ("b:0", 1))):
        text = script.read_text()
        assert re.findall(r"--this-node=(\S+)", text) == [node]
        assert f"--nproc-per-node={processes} " in text
        assert "--rdzv-endpoint=gpu-host-0:29500" in text  # the first group's first host
        bash_n(script)


def test_a_group_whose_nodes_run_unlike_counts_gets_each_its_own(tmp_path):
    """test_nodes' wide plan: group a's node 0 runs 4 ranks, node 1 runs 2; of group b's 3
    nodes the plan runs only node 0, so b's component asks for 1 node."""
    cluster = yaml.safe_dump(
        {"groups": [g | {"slurm": {"time": "60"}} for g in WIDE_CLUSTER["groups"]]}
    )
    assert launch(tmp_path, "slurm", cluster, yaml.safe_dump(WIDE_PLAN), *real(tmp_path)) == 0
    script = (tmp_path / "out" / "job.sbatch").read_text()
    assert [c["nodes"] for c in components(script)] == ["2", "1"]
    a, b = [line for line in script.splitlines() if line.startswith("srun")]
    assert "processes=(4 2); exec " in a and '--nproc-per-node="${processes[$SLURM_NODEID]}"' in a
    assert "--nproc-per-node=2 " in b and "processes=" not in b
    assert a.count("--nnodes=3 ") == 1  # three agents in all
    bash_n(tmp_path / "out" / "job.sbatch")
    flags = ("--rendezvous", "h", *real(tmp_path))
    assert launch(tmp_path, "hosts", cluster, yaml.safe_dump(WIDE_PLAN), *flags) == 0
    counts = {
        p.name: re.findall(r"--nproc-per-node=(\d+)", p.read_text())
        for p in (tmp_path / "out").glob("*.sh")
    }
    assert counts == {"a-0.sh": ["4"], "a-1.sh": ["2"], "b-0.sh": ["2"]}


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
    ids=["no-time", "signal-past-time", "bad-time", "unknown-field", "plan-misfit", "no-run-dir",
         "no-rendezvous"],
)  # fmt: skip
def test_what_cannot_be_launched_is_one_line_and_exit_2(
    tmp_path, capsys, form, cluster, plan, flags, message
):
    assert launch(tmp_path, form, cluster, plan, *flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("hethub launch: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


# test_nodes' GPU kinds, each group with its own launch: section
OWN_ENVIRONMENTS = """groups:
  - name: a
    accelerator: a100-80gb
    devices_per_node: 2
    hosts: [gpu-host-0]
    launch:
      python: /opt/cuda env/bin/python
      env: {NCCL_DEBUG: INFO, NCCL_SOCKET_IFNAME: ib0, NCCL_IB_TIMEOUT: 22}
  - name: b
    accelerator: mi250x
    devices_per_node: 1
    hosts: [amd-host-0]
    launch: {env: {NCCL_DEBUG: null, GLOO_SOCKET_IFNAME: "ib1"}}
"""


def exported(exports: str, **scheduled: str) -> dict[str, str]:
    """What a node's shell holds after a script's exports, where the scheduler set
    ``scheduled``: bash runs them."""
    shown = subprocess.run(
        ["bash", "-c", f"{exports}env -0"],
        env={"PATH": os.environ["PATH"], **scheduled},
        capture_output=True,
        text=True,
        check=True,
    )
    return dict(line.split("=", 1) for line in shown.stdout.split("\0") if line)


def test_each_group_starts_its_own_python_with_its_vendors_environment(tmp_path):
    assert launch(tmp_path, "slurm", OWN_ENVIRONMENTS, PLAN, "--time", "60", *real(tmp_path)) == 0
    script = (tmp_path / "out" / "job.sbatch").read_text()
    a, b = [shlex.split(line)[5] for line in script.splitlines() if line.startswith("srun")]
    exports_a, agent_a = a.split("exec ")
    exports_b, agent_b = b.split("exec ")
    assert agent_a.startswith("'/opt/cuda env/bin/python' -m hethub.launchers.node_agent ")
    assert agent_b.startswith("python3 -m hethub.launchers.node_agent ")  # --python's default
    # a: the vendor's NCCL_DEBUG replaced, its own variables added, every device of the node
    # unless Slurm chose them; b: the vendor's NCCL_DEBUG dropped, ROCm's visibility variable
    on_a = exported(exports_a)
    assert {k: on_a[k] for k in ("NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "NCCL_IB_TIMEOUT")} == {
        "NCCL_DEBUG": "INFO",
        "NCCL_SOCKET_IFNAME": "ib0",
        "NCCL_IB_TIMEOUT": "22",
    }
    assert on_a["CUDA_VISIBLE_DEVICES"] == "0,1" and "HIP_VISIBLE_DEVICES" not in on_a
    assert exported(exports_a, CUDA_VISIBLE_DEVICES="3,5")["CUDA_VISIBLE_DEVICES"] == "3,5"
    on_b = exported(exports_b)
    assert on_b["HIP_VISIBLE_DEVICES"] == "0" and on_b["GLOO_SOCKET_IFNAME"] == "ib1"
    assert "NCCL_DEBUG" not in on_b and "CUDA_VISIBLE_DEVICES" not in on_b
    # what only the site knows is a comment for the admin, where the group leaves it unset
    asked = [line.split("=")[0] for line in script.splitlines() if line.startswith("# export ")]
    assert asked == ["# export GLOO_SOCKET_IFNAME", "# export NCCL_IB_HCA"] + [
        "# export NCCL_SOCKET_IFNAME",
        "# export NCCL_IB_HCA",
    ]
    bash_n(tmp_path / "out" / "job.sbatch")
    # the per-host scripts: the same python and variables, as lines
    assert launch(tmp_path, "hosts", OWN_ENVIRONMENTS, PLAN, *real(tmp_path)) == 0
    host_a = (tmp_path / "out" / "a-0.sh").read_text()
    host_b = (tmp_path / "out" / "b-0.sh").read_text()
    assert "export NCCL_DEBUG=INFO\n" in host_a and "exec '/opt/cuda env/bin/python' -m " in host_a
    assert 'export HIP_VISIBLE_DEVICES="${HIP_VISIBLE_DEVICES:-0}"' in host_b
    assert "NCCL_DEBUG" not in host_b and "exec python3 -m " in host_b


def test_the_job_reads_its_own_copies_of_the_files_on_shared_storage(tmp_path, capsys):
    """The cluster and plan files where `launch` read them (often /tmp) are no place for a job:
    it reads the copies beside its script, by absolute path."""
    assert launch(tmp_path, "slurm", LOCAL_KINDS, LOCAL_PLAN) == 0
    out = tmp_path / "out"
    script = (out / "job.sbatch").read_text()
    assert f"--cluster {out / 'cluster.yaml'} --plan {out / 'plan.yaml'} " in script
    assert "This folder must be on storage every node sees" in script
    assert (out / "cluster.yaml").read_text() == LOCAL_KINDS  # as the user wrote it
    assert parse_plan(yaml.safe_load((out / "plan.yaml").read_text())) == parse_plan(
        yaml.safe_load(LOCAL_PLAN)
    )
    # a CPU cluster keeps the default length, written out in the script rather than implied
    assert "--steps 90 " in script and f"{tmp_path}/plan.yaml" not in script
    assert launch(tmp_path, "hosts", LOCAL_KINDS, LOCAL_PLAN, "--rendezvous", "h") == 0
    for name in ("fast-0.sh", "slow-0.sh"):
        text = (out / name).read_text()
        assert f"--cluster {out / 'cluster.yaml'} --plan {out / 'plan.yaml'} " in text
        assert "must be on storage every node sees (shared storage)" in text


@pytest.mark.parametrize(
    "plan, flags, missing",
    [
        (None, (), "needs --model (or --plan), --data, --steps: "),
        (PLAN, ("--steps", "5"), "needs --data: "),
        (None, ("--model", "tiny-llama", "--data", "x.txt"), "needs --steps: "),
    ],
    ids=["nothing", "plan-no-data", "model-no-steps"],
)
def test_a_cluster_of_real_accelerators_trains_no_default(tmp_path, capsys, plan, flags, missing):
    """The 3.6M-parameter local model on the pydoc texts for 90 steps is a demo: on GPUs a
    launch names the model (or a plan), the data and the steps, or is refused in one line."""
    (tmp_path / "cluster.yaml").write_text(GPU_KINDS.replace("HOST", "h0"))
    files = ["--cluster", str(tmp_path / "cluster.yaml")]
    if plan is not None:
        (tmp_path / "plan.yaml").write_text(plan)
        files += ["--plan", str(tmp_path / "plan.yaml")]
    out = ["--run-dir", "/shared/runs/x", "--out", str(tmp_path / "out"), "--time", "60"]
    assert main(["launch", "slurm", *files, *out, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hethub launch: error: cluster.yaml: a cluster of real accelerators ")
    assert missing in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_an_out_that_cannot_be_written_is_one_line(tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "launch"  # a folder under a file: no one can make it
    assert launch(tmp_path, "slurm", LOCAL_KINDS, LOCAL_PLAN, "--out", str(out)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hethub launch: error: --out = '{out}': cannot write ")
    assert "give a folder you can write" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "launch_section, said",
    [
        ("{pyhton: /x}", "groups[0].launch.pyhton"),
        ("{python: ' '}", "groups[0].launch.python = ' ': must be a non-empty string"),
        ("{env: [A, B]}", "groups[0].launch.env = ['A', 'B']: must be a mapping"),
        ("{env: {1X: a}}", "groups[0].launch.env = '1X': a variable's name is letters"),
        ("{env: {X: true}}", "groups[0].launch.env.X = True: must be a string or a whole number"),
    ],
)
def test_what_is_no_launch_section_is_refused_in_one_line(launch_section, said):
    group = {"name": "g", "accelerator": "h100", "devices_per_node": 8}
    with pytest.raises(SpecError, match=re.escape(said)):
        parse_cluster({"groups": [group | {"launch": yaml.safe_load(launch_section)}]})


@pytest.mark.parametrize(
    "text, seconds",
    [("90", 5400), ("1:30", 90), ("2:00:00", 7200), ("2-12", 216000), ("1-00:00:30", 86430)],
)
def test_slurm_time_limits_read_as_sbatch_reads_them(text, seconds):
    assert slurm_time_seconds(text, ValueError(text)) == seconds
    group = {"name": "g", "accelerator": "h100", "devices_per_node": 8, "slurm": {"time": text}}
    assert parse_cluster({"groups": [group]}).groups[0].slurm.time == text


@pytest.mark.parametrize("text", ["0", "1:2:3:4", "2h", "-5", "1-"])
def test_what_is_no_slurm_time_limit_is_refused_in_one_line(text):
    group = {"name": "g", "accelerator": "h100", "devices_per_node": 8, "slurm": {"time": text}}
    with pytest.raises(SpecError, match=r"groups\[0\]\.slurm\.time = .*must be a Slurm time"):
        parse_cluster({"groups": [group]})


def agents(folder: Path, port: int, flags: list[str]) -> list[subprocess.Popen]:
    """The per-host scripts `hethub launch hosts` writes for test_nodes' two nodes, started."""
    flags = ["--rendezvous", "127.0.0.1", "--port", str(port), "--python", sys.executable, *flags]
    cluster = GPU_KINDS.replace("HOST", json.dumps(socket.gethostname()))
    assert launch(folder, "hosts", cluster, PLAN, *flags) == 0
    return [
        subprocess.Popen(
            ["bash", str(folder / "out" / name)],
            cwd=folder,
            env=environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its workers with it: all killed together below
        )
        for name in ("a-0.sh", "b-0.sh")
    ]


def finished(started: list[subprocess.Popen]) -> list[tuple[int, str]]:
    """Each agent's exit status and stderr; any left is killed with its workers."""
    try:
        return [(agent.wait(TIMEOUT_S), agent.communicate()[1]) for agent in started]
    finally:
        for agent in started:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
            agent.communicate()


@pytest.mark.slow
def test_the_per_host_scripts_stopped_and_started_again_train_the_single_node_losses(tmp_path):
    """Both agents get SIGTERM after the first checkpoint, as Slurm's --signal sends them; the
    same scripts started again resume from the run folder and end with the single-node losses
    of an unbroken run, bit for bit."""
    (tmp_path / "cluster.yaml").write_text(GPU_KINDS.replace("HOST", "elsewhere.invalid"))
    (tmp_path / "plan.yaml").write_text(PLAN)
    real(tmp_path)  # the corpus both runs train on
    one = subprocess.run(
        [sys.executable, "-m", "hethub", "train", "--cluster", "cluster.yaml", "--plan",
         "plan.yaml", "--run-dir", "runs/one", "--steps", "4", "--timeout", "60",
         "--data", str(tmp_path / "corpus.txt")],
        cwd=tmp_path, env=environment(), capture_output=True, text=True, timeout=TIMEOUT_S,
        check=False,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr
    # the GPU kinds need the data and the steps; the agents' own --steps comes after real's 10
    flags = [*real(tmp_path), "--steps", "4", "--checkpoint-every", "1", "--timeout", "60"]
    checkpoints = tmp_path / "runs" / "r" / "checkpoints"
    store = rendezvous_store(TIMEOUT_S)  # held by the test, as in test_nodes.run_agents
    started = agents(tmp_path, store.port, flags)
    deadline = time.monotonic() + TIMEOUT_S
    while not (checkpoints.is_dir() and any(checkpoints.iterdir())):
        assert time.monotonic() < deadline and all(a.poll() is None for a in started)
        time.sleep(0.2)
    for agent in started:
        os.kill(agent.pid, signal.SIGTERM)  # bash exec'd the agent: this is torchrun
    stopped = finished(started)
    for code, said in stopped:  # one line from each agent, not torchrun's traceback
        assert code == 128 + signal.SIGTERM and "Traceback" not in said, said
        assert "hethub agent: stopped by SIGTERM" in said, said
    done = json.loads((checkpoints.parent / "metrics.jsonl").read_text().splitlines()[-1])
    assert done["step"] < 4  # stopped before the end: the second start has steps to run
    del store
    store = rendezvous_store(TIMEOUT_S)
    again = finished(agents(tmp_path, store.port, flags))
    assert [code for code, _ in again] == [0, 0], again
    # (a new run into the same run folder would have been refused: the scripts resumed it)
    metrics = [json.loads(line) for line in (checkpoints.parent / "metrics.jsonl").open()]
    reference = [json.loads(line) for line in (tmp_path / "runs/one/metrics.jsonl").open()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [m["loss"] for m in metrics] == [r["loss"] for r in reference]


@pytest.mark.slow
def test_a_node_agent_whose_worker_fails_says_so_in_one_line():
    """The node agent's failure, after its restarts: which worker and how, and no traceback."""
    agent = subprocess.run(
        [sys.executable, "-m", "hethub.launchers.node_agent", "--standalone",
         "--nproc-per-node=1", "--max-restarts=0", "--no-python", "false"],
        env=environment(), capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
    )  # fmt: skip
    assert agent.returncode == 1 and "Traceback" not in agent.stderr, agent.stderr
    assert "hethub agent: this node's worker 0 exited with status 1" in agent.stderr
