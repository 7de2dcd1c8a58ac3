"""The distributed profiler (hethub profile --cluster) under two real torchrun agents on this
machine, one per node (a node of 2 processes of group a, one of 1 process of group b, as in
tests/test_nodes.py): one folder with both groups' layer profiles and the link between them,
which load_profiles reads and hethub predict prices a plan over both groups with; a bad --out
refused with one line on both nodes. And the pure half: the link between nodes in the store, and
the predictor pricing a cross-group send by it, with no torch imported."""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_nodes import environment, run_agents

from hethub.predictor.iteration import predict
from hethub.profiles.files import load_profiles, save_profile
from hethub.profiles.selection import Profiles
from hethub.profiles.types import LayerKey, LayerProfile, LinkProfile
from hethub.spec import load_model, parse_cluster, parse_plan

CLUSTER = """groups:
  - {name: a, accelerator: a100-80gb, nodes: 1, devices_per_node: 2}
  - {name: b, accelerator: mi250x, nodes: 1, devices_per_node: 1}
"""
# A stage on each group: its send crosses from a's node to b's, through the bridge.
PLAN = {
    "model": "tiny-llama",
    "global_batch": 4,
    "micro_batch": 1,
    "precision": "fp32",
    "pipelines": [
        {
            "micro_batches": 4,
            "stages": [{"group": "a", "tp": 1, "layers": 5}, {"group": "b", "tp": 1, "layers": 3}],
        }
    ],
}
TIMEOUT_S = 240  # 2 agents, 3 workers and their measuring processes on a shared 2 cores


def node_command(port: int, node: str, processes: int, out: str) -> list[str]:
    """What the user runs on one node (docs/clusters.md, "Distributed profiling")."""
    return [
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"),
        *("--nproc-per-node", str(processes), "--rdzv-backend", "c10d"),
        *("--rdzv-endpoint", f"127.0.0.1:{port}"),
        *("-m", "hethub", "profile", "--cluster", "cluster.yaml", "--model", "tiny-llama"),
        *("--this-node", node, "--out", out),
        *("--tp", "1", "--micro-batch", "1", "--dtype", "fp32", "--repeats", "2"),
        *("--timeout", "120"),
    ]


def two_nodes(folder: Path, out: str) -> dict[str, tuple[int, str, str]]:
    """Node a:0 (2 processes) and node b:0 (1); per node: exit status, stdout, stderr."""
    nodes = (("a:0", 2), ("b:0", 1))
    done = run_agents(
        folder, lambda port: [node_command(port, n, p, out) for n, p in nodes], TIMEOUT_S
    )
    return dict(zip((n for n, _ in nodes), done, strict=True))


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    (tmp_path / "plan.yaml").write_text(json.dumps(PLAN))
    return tmp_path


@pytest.mark.slow
def test_two_torchrun_nodes_write_one_folder_that_predict_prices_both_groups_with(folder):
    done = two_nodes(folder, "profiles")
    for node, (code, _, err) in done.items():
        assert code == 0, f"node {node}:\n{err}"
    profiles = load_profiles(folder / "profiles")
    model = load_model("tiny-llama")
    for kind in ("a100-80gb", "mi250x"):  # each group's layers, at the key predict looks up
        selected = profiles.select(dtype="fp32", threads=1, concurrent_ranks=1)
        assert selected.layer_for(kind, model, 1, 1) is not None, kind
        assert selected.link_for(kind) is not None, kind
    bridge = profiles.link_between("mi250x", "a100-80gb")
    assert bridge is not None and bridge.peer is not None and bridge.p2p_bytes_per_s > 0
    # every file says where it was measured: both nodes are this host here
    written = [*profiles.layers.values(), *profiles.links.values(), bridge]
    assert {p.measured_on.host for p in written} == {socket.gethostname()}
    predicted = subprocess.run(
        [sys.executable, "-m", "hethub", "predict", "--cluster", "cluster.yaml", "--plan",
         "plan.yaml", "--profiles", "profiles"],
        cwd=folder, env=environment(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert predicted.returncode == 0, predicted.stderr
    assert re.search(
        r"^priced by +measured profiles in profiles$", predicted.stdout, re.MULTILINE
    ), predicted.stdout
    assert "missing profile" not in predicted.stdout and "note:" not in predicted.stderr


@pytest.mark.slow
def test_an_out_folder_rank_0_cannot_write_is_one_line_on_every_node(folder):
    (folder / "taken").write_text("a file, not a folder")
    done = two_nodes(folder, "taken/profiles")
    for node, (code, out, err) in done.items():
        lines = [line for line in err.splitlines() if line.startswith("hethub profile: error: ")]
        assert code != 0 and out == "" and lines, f"node {node}:\n{err}"
        assert "--out = 'taken/profiles': cannot write there" in lines[0], err
        assert len(set(lines)) == 1  # the same line from each of the node's processes
        assert "Traceback" not in "\n".join(
            line for line in err.splitlines() if "hethub" in line and "error" not in line
        )


# --- the pure half: the store and the predictor --------------------------------------------------


def link(device: str, peer: str | None, bandwidth: float) -> LinkProfile:
    return LinkProfile(
        device=device,
        peer=peer,
        concurrent_ranks=2 if peer else 1,
        p2p_latency_s=1e-4,
        p2p_bytes_per_s=bandwidth,
        allreduce={2: (1e-4, bandwidth)},
        broadcast={2: (1e-4, bandwidth)},
        allgather={2: (1e-4, bandwidth)},
        measured_at="2025-01-01T00:00:00+00:00",
    )


def layer(device: str) -> LayerProfile:
    key = LayerKey.of(
        load_model("tiny-llama"),
        device=device,
        dtype="fp32",
        threads=1,
        concurrent_ranks=1,
        tp=1,
        micro_batch=1,
    )
    times = dict.fromkeys(
        ("layer_forward_s", "layer_backward_s", "embed_forward_s", "embed_backward_s"), 1e-3
    )
    return LayerProfile(
        key=key,
        **times,
        head_forward_s=1e-3,
        head_backward_s=1e-3,
        optimizer_s_per_param=1e-9,
        layer_activation_bytes=1 << 20,
        layer_param_bytes=1 << 20,
        measured_at="2025-01-01T00:00:00+00:00",
    )


def test_a_link_between_nodes_is_stored_by_its_pair_of_kinds(tmp_path):
    inside = link("mi250x", None, 1e9)
    between = link("a100-80gb", "mi250x", 1e8)
    for p in (inside, between):
        save_profile(tmp_path, p)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["link-a100-80gb-to-mi250x-nodes.json", "link-mi250x-c1.json"]
    assert "peer" not in json.loads((tmp_path / "link-mi250x-c1.json").read_text())
    loaded = load_profiles(tmp_path)
    assert loaded.link("mi250x", 1) == inside and loaded.links == {("mi250x", 1): inside}
    assert loaded.link_between("mi250x", "a100-80gb") == between  # either order
    assert loaded.link_between("a100-80gb", "a100-80gb") is None


def test_predict_prices_the_cross_group_send_by_the_measured_link_between_nodes():
    cluster = parse_cluster(json.loads(json.dumps(_cluster_data())), "c.yaml")
    plan = parse_plan(PLAN, "plan.yaml")
    model = load_model("tiny-llama")
    base = Profiles(
        layers={p.key: p for p in (layer("a100-80gb"), layer("mi250x"))},
        links={(k, 1): link(k, None, 1e9) for k in ("a100-80gb", "mi250x")},
        source="here",
    ).select(dtype="fp32")
    without = predict(plan, cluster, model, profiles=base)
    slow, fast = (
        dataclasses.replace(base, between={pair: link(*pair, bandwidth)})
        for pair, bandwidth in ((("a100-80gb", "mi250x"), 1e6), (("a100-80gb", "mi250x"), 1e12))
    )
    nbytes = 1 * model.seq_len * model.hidden * 4
    sends = [predict(plan, cluster, model, profiles=p).stages[0].send_s for p in (slow, fast)]
    assert sends[0] == pytest.approx(1e-4 + nbytes / 1e6)  # the measured link, as measured
    assert sends[1] == pytest.approx(1e-4 + nbytes / 1e12)
    assert without.stages[0].send_s not in sends  # without it: the analytic bridge


def _cluster_data() -> dict:
    return {
        "groups": [
            {"name": "a", "accelerator": "a100-80gb", "nodes": 1, "devices_per_node": 2},
            {"name": "b", "accelerator": "mi250x", "nodes": 1, "devices_per_node": 1},
        ]
    }


def test_the_predictor_and_the_planner_import_no_torch():
    code = (
        "import sys; import hethub.predictor.iteration, hethub.planner.search, "
        "hethub.profiles.files; assert 'torch' not in sys.modules, 'torch imported'"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=environment(), capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
