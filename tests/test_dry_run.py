"""`hethub train --dry-run`: every rank of a plan built in one process on torch's fake backend
and the meta device, its memory against the prediction, its sends matched to its receives."""

from __future__ import annotations

import dataclasses
import gc
import json
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hethub.cli import main
from hethub.comm import Communicator
from hethub.errors import HethubError
from hethub.predictor.memory import layer_activation_bytes, layers_bytes, selective_saving_bytes
from hethub.runtime.dry_run import (
    FAKE_BACKEND,
    StageReport,
    fake_rank_groups,
    fake_world,
    member_groups,
    rank_state,
)
from hethub.runtime.model import Stage, StageChunks
from hethub.runtime.precision import MasterWeights
from hethub.runtime.process_groups import create_groups, job_groups, rank_groups
from hethub.runtime.saved_tensors import saved_inventory, stage_inputs
from hethub.spec import check_plan, load_cluster, load_model, load_plan
from hethub.spec.agreement import check_agreement, walk_messages
from hethub.spec.collectives import Kind, Post, rank_transfers, stage_posts
from hethub.spec.model import parse_model
from hethub.spec.ops import Kernels
from hethub.spec.plan import Precision, Recompute
from hethub.spec.schedules import Schedule, chunk_sequence, stage_model_chunks
from hethub.spec.topology import build_topology

# Two vendors, so the plan's gradient sync spans the bridge (SYNC_LOCAL and SYNC_BRIDGE groups).
CLUSTER = """
groups:
  - {name: nv, accelerator: a100-80gb, nodes: 1, devices_per_node: 4}
  - {name: amd, accelerator: mi250x, nodes: 1, devices_per_node: 2}
cross_group_gbps: 100
"""
MODEL = "{arch: llama, hidden: 64, layers: 4, heads: 4, vocab: 256, seq_len: 32}"
PLAN = """
model: {model}
global_batch: 8
micro_batch: 1
schedule: {schedule}
pipelines:
- count: 1
  micro_batches: 4
  stages:
  - {{group: nv, tp: 2, layers: 2}}
  - {{group: nv, tp: 2, layers: 2}}
- count: 1
  micro_batches: 4
  stages:
  - {{group: amd, tp: 1, layers: 2}}
  - {{group: amd, tp: 1, layers: 2}}
"""


@pytest.fixture
def files(tmp_path):
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    (tmp_path / "tiny.yaml").write_text(MODEL)

    def plan(schedule: str = "1f1b") -> tuple[str, str]:
        path = tmp_path / f"plan-{schedule}.yaml"
        path.write_text(PLAN.format(model="tiny.yaml", schedule=schedule))
        return str(tmp_path / "cluster.yaml"), str(path)

    return plan


def test_a_small_plan_dry_runs_and_reports_every_stage(files, capsys):
    cluster, plan = files()
    assert main(["train", "--cluster", cluster, "--plan", plan, "--dry-run", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ranks"] == 6
    stages = {(s["pipeline"], s["stage"]): s for s in report["stages"]}
    assert sorted(stages) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert stages[(0, 0)]["ranks"] == [0, 1] and stages[(1, 1)]["group"] == "amd"
    for stage in report["stages"]:
        # The runtime's own state is the predictor's, within the dry run's tolerance; so are
        # the activations its stages save, TP 2's through the fake group, one micro-batch's
        # times those in flight (1F1B: 2 on the first stage, 1 on the last).
        assert stage["state_gb"] == pytest.approx(stage["predicted_state_gb"], rel=0.05)
        assert stage["activations_gb"] == pytest.approx(stage["predicted_activations_gb"], rel=0.01)
        assert stage["memory_gb"] == pytest.approx(stage["predicted_memory_gb"], rel=0.05)
    # TP 2 halves what a layer keeps but for its norms' and residuals' whole inputs
    assert 0.5 < stages[(0, 1)]["activations_gb"] / stages[(1, 1)]["activations_gb"] < 0.7
    assert stages[(1, 0)]["activations_gb"] > 1.9 * stages[(1, 1)]["activations_gb"]
    # Two pipelines of 2 stages, 4 micro-batches: one activation and one gradient each.
    assert report["messages"] == 2 * 2 * 4
    # Each of the step's collectives counted once: every rank's share of each group's.
    assert report["collectives"] == collectives_once(_transfers(files).values())


@pytest.mark.parametrize("variant", ["sequence-parallel", "interleaved"])
def test_sequence_parallel_and_interleaved_stages_save_what_the_predictor_says(
    variant, tmp_path, capsys
):
    # Sequence parallelism: TP 2's layers keep their shards, the inputs (B, T/2, h); interleaved
    # 1F1B: each chunk's inventory, by the micro-batches in flight the predictor reads.
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    (tmp_path / "tiny.yaml").write_text(MODEL)
    plan = PLAN.format(model="tiny.yaml", schedule="1f1b")
    if variant == "sequence-parallel":
        plan += "sequence_parallel: true\n"
    else:
        plan = plan.replace("schedule: 1f1b", "schedule: interleaved-1f1b")
        plan = plan.replace("micro_batches: 4", "micro_batches: 4\n  virtual_stages: 2")
        plan = plan.replace("layers: 2}", "layers: [1, 1]}")
    (tmp_path / "plan.yaml").write_text(plan)
    argv = ["train", "--cluster", str(tmp_path / "cluster.yaml"), "--plan"]
    assert main([*argv, str(tmp_path / "plan.yaml"), "--dry-run", "--json"]) == 0
    for stage in json.loads(capsys.readouterr().out)["stages"]:
        assert stage["activations_gb"] == pytest.approx(stage["predicted_activations_gb"], rel=0.01)
        assert stage["verdict"] == "ok"


def test_the_text_report_has_a_line_per_stage(files, capsys):
    cluster, plan = files()
    assert main(["train", "--cluster", cluster, "--plan", plan, "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 5 and all(line.endswith(", ok") for line in lines[:4])
    assert lines[-1].startswith("dry run: 6 ranks built, 16 messages a step matched, ")
    assert lines[-1].endswith(" collectives agreed by their ranks")


def test_a_dry_run_needs_a_plan(files, capsys):
    cluster, _ = files()
    assert main(["train", "--cluster", cluster, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--dry-run needs --cluster and --plan" in err


@pytest.mark.parametrize(
    ("schedule", "stages", "chunks"),
    [
        (Schedule.ONE_F_ONE_B, 4, 1),
        (Schedule.GPIPE, 3, 1),
        (Schedule.INTERLEAVED_1F1B, 4, 2),
        (Schedule.ZB_H1, 4, 1),
        (Schedule.ZBV, 4, 2),
    ],
)
def test_every_schedule_sends_what_its_peers_receive(schedule, stages, chunks):
    micro_batches = 8
    orders = [chunk_sequence(schedule, s, stages, chunks, micro_batches) for s in range(stages)]
    posts = stage_posts(orders, stage_model_chunks(schedule, stages, chunks))
    # Each model chunk boundary between two stages carries one activation and one gradient
    # per micro-batch (ZBV's turn stays on its stage).
    boundaries = stages * chunks - 1 - (1 if schedule == Schedule.ZBV else 0)
    assert walk_messages(posts) == 2 * boundaries * micro_batches


def test_two_stages_that_both_receive_first_deadlock():
    activation = ("activation", 0, 0)
    gradient = ("gradient", 1, 0)
    posts = [
        [Post(False, 1, gradient), Post(True, 1, activation)],
        [Post(False, 0, activation), Post(True, 0, gradient)],
    ]
    with pytest.raises(HethubError, match=r"stage 0 waits forever .* \(deadlock\)"):
        walk_messages(posts, lambda s: f"stage {s}")


def test_sends_out_of_the_receivers_order_are_a_mismatch():
    orders = [chunk_sequence(Schedule.ONE_F_ONE_B, s, 2, 1, 4) for s in range(2)]
    orders[0][0], orders[0][1] = orders[0][1], orders[0][0]  # stage 0 sends micro-batch 1 first
    posts = stage_posts(orders, stage_model_chunks(Schedule.ONE_F_ONE_B, 2, 1))
    with pytest.raises(HethubError, match="must match in order") as refused:
        walk_messages(posts)
    assert "\n" not in str(refused.value)


def test_a_send_nobody_receives_is_refused():
    posts = [[Post(True, 1, ("activation", 0, 0))], []]
    with pytest.raises(HethubError, match="never receives it"):
        walk_messages(posts)


def test_a_rank_over_its_devices_memory_exits_2(files, tmp_path, capsys):
    _, plan = files()
    small = CLUSTER.replace(
        "accelerator: mi250x",
        "accelerator: {name: tiny-mem, vendor: amd, bf16_tflops: 100, memory_gb: 0.000001}",
    )
    (tmp_path / "small.yaml").write_text(small)
    code = main(["train", "--cluster", str(tmp_path / "small.yaml"), "--plan", plan, "--dry-run"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0
    assert "memory" in err


def _job(files):
    """The two-vendor plan of ``files`` loaded: plan, cluster, model, topology, vendors."""
    cluster_path, plan_path = files()
    cluster, plan = load_cluster(cluster_path), load_plan(plan_path)
    model = load_model(plan.model, relative_to=Path(plan_path).parent)
    topology = build_topology(plan, cluster)
    return plan, cluster, model, topology, topology.vendors(cluster)


def test_each_rank_creates_only_its_groups_and_holds_what_creating_all_of_them_gives(files):
    plan, cluster, model, topology, vendors = _job(files)
    check_plan(plan, cluster, model)
    specs = job_groups(topology, model, vendors, vendors, data_parallel=True)
    own = member_groups(specs)
    faked = [dataclasses.replace(s, backend=FAKE_BACKEND) for s in specs]

    def handles(created):
        """Each group's ranks as torch's handle holds them (None: no handle)."""
        return {
            key: None if g.handle is None else dist.get_process_group_ranks(g.handle)
            for key, g in created.items()
        }

    for rank in range(topology.world_size):
        # A rank's share of the job's list: every group it is in, in the list's order.
        assert own[rank] == [s for s in specs if rank in s.ranks]
        with fake_world(rank, topology.world_size):
            everything = handles(create_groups(faked))
        with fake_world(rank, topology.world_size):
            alone = handles(
                create_groups(
                    [dataclasses.replace(s, backend=FAKE_BACKEND) for s in own[rank]],
                    members_only=True,
                )
            )
            groups = fake_rank_groups(topology, model, vendors, own[rank], data_parallel=True)
            assert groups.tp.ranks == topology.tp_group(rank)
        assert alone == everything
        assert all(ranks == list(key[1]) for key, ranks in everything.items() if ranks)
        # The groups it holds are the pure function's, now with handles.
        pure = rank_groups(topology, model, vendors, rank, data_parallel=True)
        assert groups.tp.ranks == pure.tp.ranks and groups.vendor.ranks == pure.vendor.ranks
        assert groups.grad_sync.keys() == pure.grad_sync.keys()
    # The plan's sync sets span both vendors: the bridge's groups were among those created.
    assert any(s.role == "sync_bridge" for s in specs)


def test_a_built_rank_leaves_nothing_behind_for_the_next(files):
    # Each rank's stage, buffers and optimizer must go when it is done: the dry run's memory is
    # one rank's, not the job's (a 4,088-rank plan otherwise grows by 1.2 GB).
    plan, _, model, topology, vendors = _job(files)
    own = member_groups(job_groups(topology, model, vendors, vendors))

    def alive() -> int:
        gc.collect()
        return sum(type(o) is MasterWeights for o in gc.get_objects())

    before = alive()
    for rank in range(topology.world_size):
        with fake_world(rank, topology.world_size):
            groups = fake_rank_groups(topology, model, vendors, own[rank], data_parallel=False)
            # its forward measured too: the graph it leaves goes with it
            state = rank_state(
                plan, topology, model, groups, Communicator(vendors), kernels=Kernels.FUSED
            )
        # built and run (its figures against the predictor's: the dry run's test above)
        assert state.weights > 0 and state.saved.layers > 0
    del groups
    assert alive() == before


def _transfers(files):
    """Every rank's transfers of one step of the two-vendor plan (TP 2 beside TP 1)."""
    plan, _, model, topology, vendors = _job(files)
    return {
        rank: rank_transfers(plan, topology, model, vendors, rank, grad_norm=True)
        for rank in range(topology.world_size)
    }


def collectives_once(transfers_of_ranks) -> int:
    """The collectives (no sends, no receives) of every rank's transfers, each counted once: a
    rank's share of one is 1 / the size of its group."""
    shares = sum(
        Fraction(1, len(t.ranks))
        for transfers in transfers_of_ranks
        for t in transfers
        if t.kind not in (Kind.SEND, Kind.RECV)
    )
    assert shares.denominator == 1  # every rank of every group took part
    return int(shares)


def test_the_ranks_agree_on_every_collective_and_a_broken_plan_of_them_is_refused(files):
    transfers = _transfers(files)
    assert check_agreement(transfers.items()) == collectives_once(transfers.values())
    # the TP-1 amd rank 4 sums each half of a bucket with one of nv's TP ranks (classes),
    # then the gradient norm with every rank
    rank = 4
    mine = transfers[rank]
    sums = [i for i, t in enumerate(mine) if t.kind is Kind.ALL_REDUCE and len(t.ranks) == 2]
    first = mine[sums[0]]
    # the norm first: its class partner waits in the class sum, rank 4 in the norm (deadlock)
    norm_first = [mine[-1], *mine[:-1]]
    with pytest.raises(HethubError, match="waits forever"):
        check_agreement({**transfers, rank: norm_first}.items())
    # a bucket padded otherwise on one rank: the same order, another size
    resized = list(mine)
    resized[sums[0]] = dataclasses.replace(first, nbytes=first.nbytes + 4)
    with pytest.raises(HethubError, match="in one order and size"):
        check_agreement({**transfers, rank: resized}.items())
    # a rank that leaves a class's sums out
    without = [t for t in mine if t.ranks != first.ranks]
    with pytest.raises(HethubError, match=f"rank {rank} (never reaches it|waits in another)"):
        check_agreement({**transfers, rank: without}.items())
    receiver = next(r for r, ts in transfers.items() if any(t.kind is Kind.RECV for t in ts))
    deaf = [t for t in transfers[receiver] if t.kind is not Kind.RECV]
    with pytest.raises(HethubError, match="every send needs its receive"):
        check_agreement({**transfers, receiver: deaf}.items())


TINY = parse_model(
    {
        "arch": "llama",
        "hidden": 64,
        "layers": 4,
        "heads": 4,
        "kv_heads": 2,
        "vocab": 256,
        "seq_len": 32,
    },
    "test",
    "tiny",
)


def _tiny_stage(device: str, *, is_first: bool) -> StageChunks:
    """Layers 1 and 2 of TINY (TP 1) in bf16 on ``device``: drawn weights on the CPU, shapes
    only on meta."""
    if device == "cpu":
        stage = Stage.build(TINY, 1, 2, None, is_first=is_first, is_last=False, seed=0)
    else:
        with torch.device("meta"):
            stage = Stage(TINY, 1, 2, None, is_first=is_first, is_last=False)
    return StageChunks([stage.to(torch.bfloat16)])


def _inventory(device: str, recompute: Recompute, *, is_first: bool = False):
    stage = _tiny_stage(device, is_first=is_first)
    inputs = stage_inputs(stage, TINY, 2, torch.bfloat16, device)
    return saved_inventory(stage, inputs, recompute, Kernels.CPU, Precision.BF16)


@pytest.mark.parametrize("recompute", list(Recompute))
def test_a_meta_forward_saves_what_a_real_cpu_forward_of_the_stage_saves(recompute):
    # The CPU runs flash attention and runtime.model's RMSNorm (the fused kernel's saves); on
    # meta, where torch would fall back to the math attention (its fp32 scores) and a composite
    # RMSNorm (fp32 copies), the dry run runs the device's kernels: the same bytes, exactly.
    for is_first in (False, True):
        real = _inventory("cpu", recompute, is_first=is_first)
        assert _inventory("meta", recompute, is_first=is_first) == real
    # And it is what the predictor says two layers keep for one micro-batch of 2 sequences.
    per_layer = layer_activation_bytes(TINY, 1, 2, Precision.BF16, Kernels.CPU)
    if recompute is Recompute.SELECTIVE:
        per_layer -= selective_saving_bytes(TINY, 1, 2, Precision.BF16, Kernels.CPU)
    predicted = layers_bytes(
        TINY,
        per_layer=per_layer,
        bytes_per_element=Precision.BF16.element_bytes,
        layers=2,
        in_flight=3,
        micro_batch=2,
        recompute=recompute,
    )
    assert real.activations(3) == pytest.approx(predicted, rel=0.01)
    assert real.head == 0 and (real.rebuilt > 0) == (recompute is Recompute.FULL)


def test_full_recomputation_keeps_far_less_than_none():
    none, full = _inventory("meta", Recompute.NONE), _inventory("meta", Recompute.FULL)
    # each layer's input, 2 x 32 tokens x 64 bf16 features, against everything a layer saves
    assert full.layers == 2 * 2 * 32 * 64 * 2
    assert full.layers < none.layers / 5
    # one layer rebuilt in a backward: what it saves without recomputation, less its input
    assert full.rebuilt == none.layers // 2 - full.layers // 2


def test_the_verdict_names_the_part_that_is_off():
    report = StageReport(
        pipeline=0,
        stage=1,
        group="nv",
        ranks=[2, 3],
        device_gb=80,
        predicted_state_gb=10.0,
        predicted_activations_gb=20.0,
        predicted_buffers_gb=2.0,
        state_gb=10.1,
        activations_gb=24.0,
    )
    assert report.memory_gb == pytest.approx(36.1)
    assert report.verdict == "12.8% off the prediction: activations +12.5% of it"
    report.activations_gb = 20.5
    assert report.verdict == "ok"
