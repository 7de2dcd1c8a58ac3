"""Unlike nodes launched in any order (hethub.runtime.nodes): the pure mapping from (group, node,
LOCAL_RANK) to the plan's rank, its refusals, the cluster's hosts, and two real torchrun agents
on this machine playing a node of 2 processes of one group and a node of 1 of another, started
in both orders: the losses of the single-node run, bit for bit; a launch that does not fit the
plan is refused with one line on both nodes."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import hethub
from hethub.cli import main
from hethub.errors import HethubError
from hethub.runtime.nodes import Claim, check_claim, node_of_host, node_ranks, plan_ranks
from hethub.runtime.spawn import rendezvous_store
from hethub.spec import parse_cluster, parse_plan
from hethub.spec.topology import build_topology

# Two vendors, run on this machine's CPU (no such GPU here): group a's node holds 2 devices, b's 1.
# Group a's node is this machine by name, so that a node a:0 without --this-node finds itself.
CLUSTER = """groups:
  - {{name: a, accelerator: a100-80gb, nodes: 1, devices_per_node: 2, hosts: [{host}]}}
  - {{name: b, accelerator: mi250x, nodes: 1, devices_per_node: 1, hosts: [elsewhere.invalid]}}
"""
# A TP-2 stage on a's node, then a stage on b's: which process is which matters to the plan.
PLAN = """model: tiny-llama
global_batch: 4
micro_batch: 1
precision: fp32
pipelines:
  - count: 1
    micro_batches: 4
    stages:
      - {group: a, tp: 2, layers: 5}
      - {group: b, tp: 1, layers: 3}
"""

# For the pure mapping: unlike nodes and counts. Group a: 2 nodes of 4; the plan's two TP-2
# stages fill node 0 and its two TP-1 stages half of node 1. Group b: 3 nodes of 2; the plan
# uses node 0 only.
WIDE_CLUSTER = {
    "groups": [
        {"name": "a", "accelerator": "h100", "nodes": 2, "devices_per_node": 4},
        {"name": "b", "accelerator": "mi300x", "nodes": 3, "devices_per_node": 2},
    ]
}
WIDE_PLAN = {
    "model": "tiny-llama",
    "global_batch": 8,
    "pipelines": [
        {"count": 2, "stages": [{"group": "a", "tp": 2, "layers": 4}, {"group": "a", "layers": 4}]},
        {"count": 2, "stages": [{"group": "b", "layers": 8}]},
    ],
}


def wide():
    cluster = parse_cluster(WIDE_CLUSTER, "wide.yaml")
    return cluster, build_topology(parse_plan(WIDE_PLAN, "plan.yaml"), cluster)


def claims_in_order(nodes, topology, counts=None, host="h"):
    """The claims torchrun numbers in this order of nodes: each node's processes after the
    previous node's, by LOCAL_RANK (``counts`` overrides a node's --nproc-per-node)."""
    ranks = node_ranks(topology)
    counts = counts or {}
    claims = []
    for node in nodes:
        n = counts.get(node, len(ranks.get(node, ())))
        claims += [
            Claim(node[0], node[1], local, n, f"{host}-{node[0]}{node[1]}") for local in range(n)
        ]
    return claims


def test_every_order_of_unlike_nodes_gives_each_process_its_place_in_the_plan():
    cluster, topology = wide()
    ranks = node_ranks(topology)
    assert {node: len(r) for node, r in ranks.items()} == {("a", 0): 4, ("a", 1): 2, ("b", 0): 2}
    for order in itertools.permutations(ranks):
        claims = claims_in_order(order, topology)
        mapped = plan_ranks(claims, topology, cluster)
        assert sorted(mapped) == list(range(topology.world_size))
        for claim, rank in zip(claims, mapped):
            info = topology.ranks[rank]
            assert (info.group, info.node) == (claim.group, claim.node)
            # LOCAL_RANK picks the node's device: the plan's ranks fill each node from device 0
            per_node = cluster.group(info.group).devices_per_node
            assert info.device % per_node == claim.local_rank
    # An order torchrun's rendezvous may well pick, b's node first: its processes are plan
    # ranks 6 and 7 (after group a's six), not 0 and 1.
    claims = claims_in_order([("b", 0), ("a", 1), ("a", 0)], topology)
    assert plan_ranks(claims, topology, cluster) == [6, 7, 4, 5, 0, 1, 2, 3]


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda c: c[:-1],
            (
                "torchrun started 7 processes, the plan needs 8: one torchrun per node of the "
                "plan, each with --nproc-per-node its ranks (a:0 4, a:1 2, b:0 2)"
            ),
        ),
        (
            lambda c: [Claim("c", 0, 0, 4, "x"), *c[1:]],
            "torchrun rank 0 (node c:0): no group 'c' in wide.yaml; its groups: a, b",
        ),
        (
            lambda c: [Claim("a", 2, 0, 4, "x"), *c[1:]],
            (
                "torchrun rank 0 (node a:2): group 'a' has 2 nodes: INDEX counts them from 0, "
                "so it is 0 to 1"
            ),
        ),
        (
            # a's node 1 started with 3 processes, b's node 0 with 1
            lambda c: [*c[:4], *[Claim("a", 1, i, 3, "x") for i in range(3)], c[6]],
            (
                "torchrun rank 4 (node a:1): torchrun started 3 processes on x, the plan has 2 "
                "ranks on node a:1: give its torchrun --nproc-per-node 2"
            ),
        ),
        (
            lambda c: [*c[:6], Claim("b", 1, 0, 2, "y"), Claim("b", 1, 1, 2, "y")],
            (
                "torchrun rank 6 (node b:1): torchrun started 2 processes on y, the plan uses no "
                "device of node b:1: start no torchrun there"
            ),
        ),
        (
            lambda c: [*c[:4], *c[:4]],  # two torchruns given --this-node a:0
            (
                "node a:0 local rank 0 is claimed twice, by torchrun rank 0 on h-a0 and torchrun "
                "rank 4 on h-a0: give each node's torchrun its own --this-node GROUP:INDEX"
            ),
        ),
    ],
)
def test_a_launch_that_does_not_fit_the_plan_is_refused_in_one_line(change, message):
    cluster, topology = wide()
    claims = change(claims_in_order([("a", 0), ("a", 1), ("b", 0)], topology))
    with pytest.raises(HethubError) as refused:
        plan_ranks(claims, topology, cluster)
    assert str(refused.value) == message


def test_unknown_groups_get_a_did_you_mean():
    cluster, topology = wide()
    with pytest.raises(HethubError, match=r"no group 'aa' in wide\.yaml \(did you mean 'a'\?\)"):
        check_claim(Claim("aa", 0, 0, 3, "h"), topology, cluster, "--this-node = 'aa:0'")


def test_a_host_finds_its_node_by_its_name_or_fqdn_in_the_cluster_hosts():
    hosted = {
        "groups": [
            {**WIDE_CLUSTER["groups"][0], "hosts": ["gpu-0.lab", "GPU-1.lab"]},
            {**WIDE_CLUSTER["groups"][1], "hosts": ["amd-0", "amd-1", "amd-2"]},
        ]
    }
    cluster = parse_cluster(hosted, "c.yaml")
    assert node_of_host(cluster, ["gpu-1", "gpu-1.lab"]) == ("a", 1)  # the FQDN, any case
    assert node_of_host(cluster, ["amd-2", "amd-2.lab"]) == ("b", 2)
    assert node_of_host(cluster, ["login", "login.lab"]) is None
    assert node_of_host(parse_cluster(WIDE_CLUSTER), ["gpu-0.lab"]) is None  # no hosts given
    hosted["groups"][1]["hosts"][0] = "gpu-0.lab"  # one machine listed in both groups
    with pytest.raises(HethubError, match=r"is nodes a:0, b:0 in the hosts of c\.yaml: give"):
        node_of_host(parse_cluster(hosted, "c.yaml"), ["gpu-0", "gpu-0.lab"])


@pytest.mark.parametrize(
    "hosts, message",
    [
        (["n0"], "groups[0].hosts = ['n0']: must name one host per node: 2 names (nodes = 2)"),
        (
            ["n0", "n0"],
            "groups[0].hosts = ['n0', 'n0']: 'n0' is named twice: each node is its own host",
        ),
        (["n0", 1], "groups[0].hosts = ['n0', 1]: must be a non-empty list of non-empty strings"),
        ("n0", "groups[0].hosts = 'n0': must be a non-empty list of non-empty strings"),
    ],
)
def test_bad_hosts_are_one_line_naming_the_field_and_the_rule(hosts, message):
    data = {"groups": [{"name": "a", "accelerator": "cpu", "nodes": 2, "devices_per_node": 1}]}
    data["groups"][0]["hosts"] = hosts
    with pytest.raises(HethubError) as refused:
        parse_cluster(data, "c.yaml")
    assert str(refused.value) == f"c.yaml: {message}"


@pytest.mark.parametrize("value", ["a", "a:", ":0", "a:-1", "a:x"])
def test_a_malformed_this_node_is_refused_by_argparse(capsys, value):
    assert main(["train", "--this-node", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0] == (
        f"hethub train: error: --this-node = {value}: must be GROUP:INDEX, a group of the "
        f"cluster file and the index of this node among the group's, from 0 (e.g. gpu:0)"
    )


def test_this_node_outside_torchrun_is_refused(capsys, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert main(["train", "--this-node", "a:0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        (
            "hethub train: error: --this-node = 'a:0': only under the user's torchrun, one per "
            "node; outside torchrun, hethub train starts every process on this machine"
        )
    ]


# ------------------------------------------------------------------------------------------------
# Two real torchrun agents on 127.0.0.1 with a c10d rendezvous, one per node.

TIMEOUT_S = 180  # a wait for one launch: 3 workers and 2 agents import torch on a shared 2 cores


@pytest.fixture
def files(tmp_path):
    (tmp_path / "cluster.yaml").write_text(CLUSTER.format(host=json.dumps(socket.gethostname())))
    (tmp_path / "plan.yaml").write_text(PLAN)
    return tmp_path


def environment() -> dict[str, str]:
    """This checkout's hethub in the children too (they run in another folder); one thread per
    worker, as hethub train gives its own."""
    source = str(Path(hethub.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def node_command(port: int, node: str | None, processes: int, run_dir: str) -> list[str]:
    """What the user runs on one node (docs/clusters.md, "Long runs on a cluster"); without a
    node, the node is the one the cluster's hosts name this machine."""
    return [
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"),
        *("--nproc-per-node", str(processes), "--rdzv-backend", "c10d"),
        *("--rdzv-endpoint", f"127.0.0.1:{port}"),
        *("-m", "hethub", "train", "--cluster", "cluster.yaml", "--plan", "plan.yaml"),
        *(("--this-node", node) if node else ()),
        *("--run-dir", run_dir, "--json"),
        *("--steps", "2", "--timeout", "60"),
    ]


def run_agents(folder: Path, commands_at, timeout_s: float) -> list[tuple[int, str, str]]:
    """Start one torchrun agent per command of ``commands_at(port)`` (their rendezvous port), in
    this order, around a rendezvous store of the test's own; per agent, in the same order: its
    exit status, stdout and stderr. Every agent and its workers are killed however it ends."""
    # The test hosts the agents' c10d rendezvous store, as a cluster's rendezvous host would:
    # both agents join it as clients. Otherwise the agent that hosts it may exit right after the
    # exit barrier, before the other agent's own rendezvous shutdown, which then fails ("The
    # connection to the C10d store has failed") and exits 1 although its workers succeeded: a
    # race of torchrun's, seen once in the profile test's two agents. Bound to a port the kernel
    # picks and held until the agents are gone, no other process can take it before they meet.
    store, agents = rendezvous_store(timeout_s), []
    try:
        for command in commands_at(store.port):
            agents.append(
                subprocess.Popen(
                    command,
                    cwd=folder,
                    env=environment(),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,  # its workers with it: all killed together below
                )
            )
        return [(agent.wait(timeout_s), *agent.communicate()) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
            agent.communicate()
        del store  # its server stops with its last reference, once no agent is left


def two_nodes(folder: Path, nodes: list[tuple[str | None, int]], run_dir: str) -> list[tuple]:
    """Start one torchrun agent per (--this-node, processes), in this order (the c10d rendezvous
    ranks the agents of one host by pid: the first started is torchrun's node 0); per agent, in
    the same order: its exit status, stdout and stderr."""
    return run_agents(
        folder,
        lambda port: [node_command(port, node, n, run_dir) for node, n in nodes],
        TIMEOUT_S,
    )


def losses(stdout: str) -> list[float]:
    return [r["loss"] for r in map(json.loads, stdout.splitlines()) if "loss" in r]


def placed(stderr: str) -> tuple[list[int], list[int]]:
    """A node's line: which torchrun ranks it ran and which plan ranks they became."""
    found = re.search(r"torchrun ranks? ([\d, ]+) (?:is|are) plan ranks? ([\d, ]+)", stderr)
    assert found, stderr
    return tuple([int(r) for r in group.split(", ")] for group in found.groups())


@pytest.mark.slow
def test_unlike_nodes_in_either_order_train_the_single_node_losses_bit_for_bit(files):
    one = subprocess.run(
        [sys.executable, "-m", "hethub", "train", "--cluster", "cluster.yaml", "--plan",
         "plan.yaml", "--run-dir", "runs/one", "--json", "--steps", "2", "--timeout", "60"],
        cwd=files, env=environment(), capture_output=True, text=True, timeout=TIMEOUT_S,
        check=False,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr
    reference = losses(one.stdout)
    assert len(reference) == 2
    # (node, its --this-node, processes) in the order started. Node a:0 says which it is with
    # --this-node when it starts first, and by its host name in the cluster's hosts when second.
    for first, order in (
        ("a:0", [("a:0", "a:0", 2), ("b:0", "b:0", 1)]),
        ("b:0", [("b:0", "b:0", 1), ("a:0", None, 2)]),
    ):
        started = two_nodes(files, [(flag, n) for _, flag, n in order], f"runs/{first[0]}-first")
        done = dict(zip([node for node, _, _ in order], started))
        for node, (code, _, err) in done.items():
            assert code == 0, f"node {node}:\n{err}"
        # torchrun numbered the node started first 0, whichever group it is; the plan did not
        torchrun = {"a:0": [0, 1], "b:0": [2]} if first == "a:0" else {"b:0": [0], "a:0": [1, 2]}
        for node, (_, _, err) in done.items():
            assert placed(err) == (torchrun[node], {"a:0": [0, 1], "b:0": [2]}[node])
        # plan rank 0 (on a's node) prints the steps, exactly as the single-node run did
        assert losses(done["a:0"][1]) == reference and losses(done["b:0"][1]) == []


@pytest.mark.slow
def test_a_launch_that_does_not_fit_the_plan_is_refused_on_every_node(files):
    # Both agents say they are a:0, the second with 1 process: the world is 3 as the plan's, so
    # only the exchange finds it; the node with 2 learns it from the other's refusal.
    done = two_nodes(files, [("a:0", 2), ("a:0", 1)], "runs/wrong")
    rule = "the plan has 2 ranks on node a:0: give its torchrun --nproc-per-node 2"
    for code, out, err in done:
        lines = [line for line in err.splitlines() if line.startswith("hethub train: error: ")]
        assert code != 0 and out == "" and lines and rule in lines[0], err
        assert len(set(lines)) == 1  # the same line from each of the node's processes
        assert "/hethub/" not in err  # no traceback of hethub's (torchrun prints its own summary)
    assert not (files / "runs" / "wrong" / "metrics.jsonl").exists()
