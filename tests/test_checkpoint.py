"""Checkpoints: a resumed run is the uninterrupted one (bit for bit under the same plan, within
1e-5 under another plan), GPT's tied head round-trips, unfinished saves are never loaded, a
checkpoint of another model is refused with a clear message, and one written before the fused
GEMMs (q, k, v, gate and up apart), or before the sharded saves (every tensor whole), loads as
the same state as its twin. Every rank saves only its own TP slice (DCP's metadata shows each
TP rank's chunk), and unlike replicas (TP 2 and TP 1) never write overlapping chunks.

Three multi-process jobs (each costs seconds of process start), run once by a module fixture,
each rank following a small script of actions; the tests check what they did.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hethub.errors import HethubError
from hethub.runtime.checkpoint import load_checkpoint, save_checkpoint
from hethub.runtime.checkpoint_folders import (
    keep_latest,
    latest_checkpoint,
    read_meta,
    remove_debris,
    verify,
)
from hethub.runtime.engine import Engine
from hethub.runtime.model import shard
from hethub.runtime.spawn import run_ranks
from hethub.spec import check_plan, load_model, parse_cluster, parse_plan
from hethub.spec.parameters import fused_parts, parameter_table
from hethub.spec.topology import build_topology

SEED, STEPS, LR = 7, 4, 1e-2
CLUSTER = parse_cluster(
    {
        "groups": [
            {"name": "nv", "accelerator": "a100-80gb", "nodes": 1, "devices_per_node": 4},
            {"name": "amd", "accelerator": "mi250x", "nodes": 1, "devices_per_node": 4},
        ]
    },
    "test",
)


def stage(group, tp, layers):
    return {"group": group, "tp": tp, "layers": layers}


def plan_dict(preset, global_batch, pipelines):
    # fp32: these tests hold resumed states to the uninterrupted run's at fp32 tolerances
    return {
        "model": preset,
        "micro_batch": 1,
        "global_batch": global_batch,
        "precision": "fp32",
        "pipelines": pipelines,
    }


# Plan A: PP 3/5 whose first stage is TP 2. Plan B: two unlike replicas, PP 6/2 and one stage.
LLAMA_A = plan_dict(
    "tiny-llama",
    2,
    [{"count": 1, "micro_batches": 2, "stages": [stage("nv", 2, 3), stage("nv", 1, 5)]}],
)
LLAMA_B = plan_dict(
    "tiny-llama",
    2,
    [
        {"count": 1, "micro_batches": 1, "stages": [stage("nv", 1, 6), stage("nv", 1, 2)]},
        {"count": 1, "micro_batches": 1, "stages": [stage("amd", 1, 8)]},
    ],
)
# GPT with its tied head on a TP 2 stage without the embedding; then two unlike replicas (TP 2
# and TP 1), each with the head on the embedding's stage. Every plan here has 3 ranks, so that
# one job (one process start) runs several.
GPT_A = plan_dict(
    "tiny-gpt",
    2,
    [{"count": 1, "micro_batches": 2, "stages": [stage("nv", 1, 4), stage("nv", 2, 4)]}],
)
GPT_B = plan_dict(
    "tiny-gpt",
    2,
    [
        {"count": 1, "micro_batches": 1, "stages": [stage("nv", 2, 8)]},
        {"count": 1, "micro_batches": 1, "stages": [stage("amd", 1, 8)]},
    ],
)


def batches(spec, global_batch):
    gen = torch.Generator().manual_seed(123)
    return [
        torch.randint(0, spec.vocab, (global_batch, spec.seq_len + 1), generator=gen)
        for _ in range(STEPS)
    ]


def world_size(plan):
    parsed = parse_plan(plan)
    check_plan(parsed, CLUSTER, load_model(plan["model"]))
    return build_topology(parsed, CLUSTER).world_size


def _engine(plan, topology, spec):
    return Engine.for_job(plan, topology, spec, CLUSTER, seed=SEED, lr=LR)


def _snapshot(engine):
    """Every parameter of this rank by full-model name: weight, exp_avg, exp_avg_sq, step."""
    return {
        name: [tensor.clone() for tensor in state]
        for name, state in engine.optimizer.local_state().items()
    }


def _job(rank, world, results, runs):
    """One rank running, one after another, each (label, plan, script) of ``runs``; per run, what
    each action did and the final state. Actions: ("train", step), ("save", dir, step),
    ("load", path), ("refused", path[, another hidden]), ("tied",). The results, tensors and
    all, go back in a file (torch.save) rather than through the multiprocessing manager."""
    torch.set_num_threads(1)  # a thread per rank: several ranks' thread pools on 2 cores spin
    torch.save(
        [_run(rank, label, plan, script) for label, plan, script in runs], f"{results}/{rank}.pt"
    )


def job(root, runs):
    """Every run of ``runs`` in one job of fresh processes (the plans' world sizes agree): per
    run, every rank's results."""
    sizes = {world_size(plan) for _, plan, _ in runs}
    assert len(sizes) == 1
    results = Path(root) / f"results-{len(list(Path(root).glob('results-*')))}"
    results.mkdir()
    run_ranks(_job, sizes.pop(), str(results), runs, timeout_s=120)
    ranks = [torch.load(results / f"{r}.pt") for r in range(len(list(results.iterdir())))]
    return list(zip(*ranks, strict=True))


def _run(rank, label, plan, script):
    spec = load_model(plan["model"])
    parsed = parse_plan(plan)
    topology = build_topology(parsed, CLUSTER)
    engine = _engine(parsed, topology, spec)
    data = batches(spec, parsed.global_batch)
    me = topology.ranks[rank]
    out = {"me": (me.tp_rank, me.tp), "losses": [], "errors": []}
    for action, *args in script:
        if action == "train":
            out["losses"].append(engine.step(data[args[0]]))
        elif action == "save":
            save_checkpoint(engine, Path(args[0]), args[1], {"plan": label})
        elif action == "load":
            out["meta"] = load_checkpoint(engine, Path(args[0]))
            out["loaded"] = _snapshot(engine)
        elif action == "load unfused":  # a checkpoint written before the fused GEMMs
            out["unfused"] = load_checkpoint(engine, Path(args[0])), _snapshot(engine)
        elif action == "load whole":  # a checkpoint written before the sharded saves
            out["whole"] = load_checkpoint(engine, Path(args[0])), _snapshot(engine)
        elif action == "refused":
            other = dataclasses.replace(spec, hidden=args[1]) if len(args) > 1 else None
            target = _engine(parsed, topology, other) if other else engine
            try:
                load_checkpoint(target, Path(args[0]))
                out["errors"].append(None)
            except HethubError as error:
                out["errors"].append(str(error))
        elif action == "tied":  # the full embedding, as each rank holding a copy of it has it
            out["tied"] = [
                engine.gather_full(name, p.detach())
                for name, p in engine.weights.named
                if name == "embed.weight"
            ]
    out["final"] = _snapshot(engine)
    return out


def read(path):
    """Every tensor of a checkpoint, read in this process without the code under test."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    state = {
        k: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for k, md in metadata.state_dict_metadata.items()
    }
    with warnings.catch_warnings():  # DCP warns that it reads in one process: it is meant to
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=path, no_dist=True)
    return state


def unfused_parts(spec, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A full-model tensor of parameter ``name`` (its weight, a moment or its step) as hethub
    saved it before the fused GEMMs, by the parameter names of then: a fused one's parts, sliced
    out of its blocks here (qkv [kv, queries + 2, d, ...]: each KV head's queries, key, value;
    gate_up [2, f, h]), each with the same step; anything else as it is."""
    layer, _, local = name.removeprefix("layers.").partition(".")
    if not name.startswith("layers.") or local not in fused_parts(spec):
        return {name: tensor}
    kind, suffix = local.split(".")
    names = ("gate", "up") if kind == "gate_up" else ("q", "k", "v")
    if tensor.dim() == 0:  # the step counter: each part's
        slices = [tensor] * len(names)
    elif kind == "gate_up":
        slices = [tensor[0], tensor[1]]
    else:
        # (kv, queries | 1 | 1, d, ...) -> (heads * d | kv * d, ...)
        slices = [t.flatten(0, 2) for t in (tensor[:, :-2], tensor[:, -2:-1], tensor[:, -1:])]
    return {f"layers.{layer}.{n}.{suffix}": t.clone() for n, t in zip(names, slices, strict=True)}


def write_unfused(saved, spec, path: Path, meta: dict, leave_out: tuple[str, ...] = ()) -> str:
    """``saved`` (every tensor of a checkpoint) written at ``path`` as hethub wrote it before the
    fused GEMMs, with DCP, the parameters ``leave_out`` left out; its path."""
    state = {}
    for key, tensor in saved.items():
        kind, name, *field = key.split("/")
        for part, value in unfused_parts(spec, name, tensor).items():
            state["/".join([kind, part, *field])] = value
    state = {k: v for k, v in state.items() if k.split("/")[1] not in leave_out}
    with warnings.catch_warnings():  # DCP warns that it writes in one process: it is meant to
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=path, no_dist=True)
    (path / "meta.json").write_text(json.dumps(meta))
    return str(path)


def write_whole(saved, path: Path, meta: dict) -> str:
    """``saved`` (every tensor of a checkpoint) written at ``path`` as hethub wrote it before
    the sharded saves: each tensor whole, one chunk; its path."""
    with warnings.catch_warnings():  # DCP warns that it writes in one process: it is meant to
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(saved, checkpoint_id=path, no_dist=True)
    (path / "meta.json").write_text(json.dumps(meta))
    return str(path)


def step_dir(root, step):
    return Path(root) / f"step-{step:06d}"


def assert_same_state(got, want):
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key


def train(*steps):
    return [("train", s) for s in steps]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Two jobs of fresh processes.
    1. Llama A: 4 steps; again, saving after steps 2 and 4. GPT A: 2 steps, save, 2 steps,
       save, load its step 2 into the trained engine and train steps 3 and 4 again.
    (Crash leftovers planted; both step-2 checkpoints rewritten as before the fused GEMMs.)
    2. Llama A, fresh: refused loads, load the unfused step 2, then resume from step 2, 2
       steps, save elsewhere.
       Llama B: resume from A's step 2, 2 steps, save over A's step 4.
       GPT B: load GPT A's unfused step 2, then resume from its step 2, 2 steps, save."""
    root = tmp_path_factory.mktemp("checkpoints")
    a, again, gpt_a, gpt_b = (str(root / name) for name in ("a", "again", "gpt-a", "gpt-b"))
    plain, first, gpt_first = job(
        root,
        [
            ("llama A", LLAMA_A, train(0, 1, 2, 3)),
            ("llama A", LLAMA_A, train(0, 1) + [("save", a, 2)] + train(2, 3) + [("save", a, 4)]),
            (
                "gpt A",
                GPT_A,
                train(0, 1)
                + [("tied",), ("save", gpt_a, 2)]
                + train(2, 3)
                + [("save", gpt_a, 4), ("load", str(step_dir(gpt_a, 2)))]
                + train(2, 3),
            ),
        ],
    )
    out = {"root": Path(a), "plain": plain, "first": first, "gpt_first": gpt_first}
    out.update(
        saved2=read(step_dir(a, 2)),
        saved4=read(step_dir(a, 4)),
        gpt_saved2=read(step_dir(gpt_a, 2)),
    )
    # A crash before the rename: DCP files, no meta.json, under a temporary name and a final one.
    for leftover in ("step-000009.tmp-x", "step-000011"):
        shutil.copytree(step_dir(a, 2), Path(a) / leftover)
        (Path(a) / leftover / "meta.json").unlink()
    out["latest"] = latest_checkpoint(Path(a))
    llama, gpt, meta = load_model("tiny-llama"), load_model("tiny-gpt"), {"plan": "A", "step": 2}
    unfused = root / "unfused"
    unfused.mkdir()
    out["unfused"] = write_unfused(out["saved2"], llama, unfused / "llama", meta)
    out["whole"] = write_whole(out["saved2"], unfused / "whole", meta)
    out["gpt_unfused"] = write_unfused(out["gpt_saved2"], gpt, unfused / "gpt", meta)
    out["torn"] = write_unfused(
        out["saved2"], llama, unfused / "torn", meta, ("layers.0.v.weight",)
    )
    out["neither"] = write_unfused(
        out["saved2"],
        llama,
        unfused / "neither",
        meta,
        ("layers.0.q.weight", "layers.0.k.weight", "layers.0.v.weight"),
    )
    out["again"], out["other"], out["gpt_other"] = job(
        root,
        [
            (
                "llama A",
                LLAMA_A,
                [
                    ("refused", f"{a}/step-000009.tmp-x"),
                    ("refused", f"{a}/step-000011"),
                    ("refused", str(step_dir(a, 99))),
                    ("refused", str(step_dir(a, 2)), 128),
                    ("refused", out["torn"]),
                    ("refused", out["neither"]),
                    ("load unfused", out["unfused"]),
                    ("load whole", out["whole"]),
                    ("load", str(step_dir(a, 2))),
                ]
                + train(2, 3)
                + [("save", again, 4)],
            ),
            ("llama B", LLAMA_B, [("load", str(step_dir(a, 2)))] + train(2, 3) + [("save", a, 4)]),
            (
                "gpt B",
                GPT_B,
                [("load unfused", out["gpt_unfused"]), ("load", str(step_dir(gpt_a, 2)))]
                + train(2, 3)
                + [("save", gpt_b, 4)],
            ),
        ],
    )
    out.update(
        again4=read(step_dir(again, 4)),
        other4=read(step_dir(a, 4)),
        gpt_other4=read(step_dir(gpt_b, 4)),
    )
    return out


@pytest.mark.slow
def test_resume_under_the_same_plan_is_bit_for_bit(jobs):
    plain = jobs["plain"]
    for uninterrupted, saving, resumed in zip(plain, jobs["first"], jobs["again"], strict=True):
        assert resumed["meta"] == {"plan": "llama A", "step": 2}
        assert saving["losses"] == uninterrupted["losses"]  # saving disturbed nothing
        assert resumed["losses"] == uninterrupted["losses"][2:]  # exactly
        for name, tensors in uninterrupted["final"].items():
            for got, want in zip(resumed["final"][name], tensors, strict=True):
                assert torch.equal(got, want), name
    assert_same_state(jobs["again4"], jobs["saved4"])
    assert_holds_shards(plain, jobs["saved4"], "final", 4)


def assert_holds_shards(ranks, saved, when, step, preset="tiny-llama"):
    """At ``when`` ("loaded": right after loading; "final"), each rank of a job of ``preset``
    held its TP shard of the checkpoint's full weights and moments, exactly."""
    table = parameter_table(load_model(preset))
    for rank in ranks:
        tp_rank, tp = rank["me"]
        for name, (weight, exp_avg, exp_avg_sq, counter) in rank[when].items():
            assert torch.equal(weight, shard(table[name], saved[f"model/{name}"], tp_rank, tp)), (
                name
            )
            for moment, tensor in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
                assert torch.equal(
                    tensor, shard(table[name], saved[f"optim/{name}/{moment}"], tp_rank, tp)
                ), name
            # AdamW's own step counter: a float32 CPU scalar.
            assert counter.dtype == torch.float32 and counter.shape == () and counter.item() == step


@pytest.mark.slow
def test_resume_under_another_plan_matches_the_uninterrupted_run(jobs):
    assert_holds_shards(jobs["other"], jobs["saved2"], "loaded", 2)
    for rank in jobs["other"]:
        torch.testing.assert_close(
            rank["losses"], jobs["plain"][0]["losses"][2:], rtol=1e-5, atol=0
        )
    # Plan B's step-4 checkpoint, written over plan A's, is what B's ranks hold: its replicas
    # and TP ranks gathered and deduplicated right.
    assert_holds_shards(jobs["other"], jobs["other4"], "final", 4)


def chunks_of(path):
    """Every key of a checkpoint with its chunks as (offsets, sizes), from DCP's metadata."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    return {
        key: sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
        for key, md in metadata.state_dict_metadata.items()
    }


def assert_written_once(path, saved):
    """Every tensor of the checkpoint at ``path`` is written exactly once: its chunks' elements
    add up to the tensor's (DCP refuses overlapping chunks); their bytes, with DCP's framing."""
    one_copy = 0
    for key, chunks in chunks_of(path).items():
        assert sum(math.prod(sizes) for _, sizes in chunks) == saved[key].numel(), key
        one_copy += saved[key].numel() * 4
    return one_copy


@pytest.mark.slow
def test_every_rank_saves_only_its_own_shard(jobs):
    """Plan A's first stage is TP 2: each of its TP ranks wrote its own half of a split tensor,
    as a chunk with its offset, and no rank wrote it whole; a tensor every TP rank holds whole
    is written once (DCP's planner keeps one copy); the TP 1 stage's tensors are one chunk."""
    path = step_dir(jobs["root"], 2)
    chunks = chunks_of(path)
    kv, blocks, d, h = jobs["saved2"]["model/layers.0.qkv.weight"].shape  # TP splits kv
    for field in ("model/layers.0.qkv.weight", "optim/layers.0.qkv.weight/exp_avg_sq"):
        assert chunks[field] == [
            ((0, 0, 0, 0), (kv // 2, blocks, d, h)),
            ((kv // 2, 0, 0, 0), (kv // 2, blocks, d, h)),
        ]
    vocab = jobs["saved2"]["model/embed.weight"].shape[0]
    assert [offsets for offsets, _ in chunks["model/embed.weight"]] == [(0, 0), (vocab // 2, 0)]
    assert chunks["model/layers.0.norm1.weight"] == [((0,), (h,))]  # whole on both TP ranks
    assert len(chunks["model/layers.4.down.weight"]) == 1  # the TP 1 stage's: whole
    one_copy = assert_written_once(path, jobs["saved2"])
    written = sum(f.stat().st_size for f in path.glob("*.distcp"))
    assert one_copy <= written < 1.1 * one_copy
    # GPT's two unlike replicas (TP 2 and TP 1) both hold every tensor, in other slices: each
    # is written by one of them, never in overlapping chunks.
    assert_written_once(step_dir(jobs["root"].parent / "gpt-b", 4), jobs["gpt_other4"])


@pytest.mark.slow
def test_unfinished_saves_are_never_loaded(jobs, tmp_path):
    root = jobs["root"]
    assert jobs["latest"] == step_dir(root, 4)
    # B replaced step 4 in place and left nothing behind but the planted leftovers.
    assert sorted(p.name for p in root.iterdir()) == [
        "step-000002",
        "step-000004",
        "step-000009.tmp-x",
        "step-000011",
    ]
    incomplete = "is incomplete: no meta.json (its save did not finish)"
    for rank in jobs["again"]:
        tmp, no_meta, missing, *_ = rank["errors"]
        assert tmp == f"checkpoint {root / 'step-000009.tmp-x'} {incomplete}"
        assert no_meta == f"checkpoint {root / 'step-000011'} {incomplete}"
        assert missing == f"checkpoint {step_dir(root, 99)} does not exist"
    # Pure filesystem: only step-<n> folders with meta.json count, the highest step wins.
    assert read_meta(step_dir(root, 2)) == {"plan": "llama A", "step": 2}
    with pytest.raises(HethubError) as refused:
        read_meta(root / "step-000011")
    assert str(refused.value) == f"checkpoint {root / 'step-000011'} {incomplete}"
    assert latest_checkpoint(tmp_path / "none") is None
    assert latest_checkpoint(tmp_path) is None
    for name, meta in [
        ("step-000003", True),
        ("step-000010", False),
        ("step-000012.tmp-ab", True),
        ("step-000013.old-ab", True),
        ("notes", True),
        ("step-000002", True),
    ]:
        (tmp_path / name).mkdir()
        if meta:
            (tmp_path / name / "meta.json").write_text(json.dumps({"step": 0}))
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000003"


@pytest.mark.slow
def test_a_checkpoint_of_another_model_is_refused_on_every_rank(jobs):
    path = step_dir(jobs["root"], 2)
    message = (
        f"checkpoint {path} holds embed.weight of shape [256, 64], the model needs "
        "[256, 128]: it was written for another model"
    )
    assert {rank["errors"][3] for rank in jobs["again"]} == {message}


@pytest.mark.slow
def test_gpt_tied_head_round_trips(jobs):
    first, saved = jobs["gpt_first"], jobs["gpt_saved2"]
    # The embedding (stage 0) and the head copy (stage 1, both TP ranks) were the same full
    # tensor before the save, the one the checkpoint kept.
    copies = [t for rank in first for t in rank["tied"]]
    assert len(copies) == 3
    for copy in copies:
        assert torch.equal(copy, saved["model/embed.weight"])
    assert_holds_shards(
        first, saved, "loaded", 2, "tiny-gpt"
    )  # the head copy from embed.weight too
    for rank in first:
        assert rank["losses"][4:] == rank["losses"][2:4]  # resumed in the same job: exactly
    # Under two unlike replicas (TP 2, TP 1), the head on the embedding's stage.
    assert_holds_shards(jobs["gpt_other"], saved, "loaded", 2, "tiny-gpt")
    for rank in jobs["gpt_other"]:
        torch.testing.assert_close(rank["losses"], first[0]["losses"][2:4], rtol=1e-5, atol=0)
    assert_holds_shards(jobs["gpt_other"], jobs["gpt_other4"], "final", 4, "tiny-gpt")


@pytest.mark.slow
def test_a_saved_checkpoint_lists_its_files_in_its_meta_and_verifies(jobs):
    saved = step_dir(jobs["root"].parent / "gpt-a", 4)  # two ranks wrote it
    listed = json.loads((saved / "meta.json").read_text())["files"]
    written = sorted(
        p.relative_to(saved).as_posix() for p in saved.rglob("*") if p.name != "meta.json"
    )
    assert [entry["path"] for entry in listed] == written and ".metadata" in written
    assert [entry["bytes"] for entry in listed] == [(saved / p).stat().st_size for p in written]
    assert verify(saved) is None


def _fake_checkpoint(root, name, complete=True):
    folder = Path(root) / name
    folder.mkdir(parents=True)
    if complete:
        (folder / "meta.json").write_text("{}")
    return folder


def test_only_the_latest_k_checkpoints_are_kept_and_never_the_latest_removed(tmp_path):
    for step in (2, 4, 6, 8):
        _fake_checkpoint(tmp_path, f"step-{step:06d}")
    torn = _fake_checkpoint(tmp_path, "step-000010", complete=False)  # not a checkpoint
    removed = keep_latest(tmp_path, 2)
    assert sorted(p.name for p in removed) == ["step-000002", "step-000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-000006",
        "step-000008",
        "step-000010",
    ]
    assert torn.exists() and latest_checkpoint(tmp_path).name == "step-000008"
    keep_latest(tmp_path, 0)  # asks for none: the latest stays all the same
    assert latest_checkpoint(tmp_path).name == "step-000008"


def test_what_crashed_saves_left_is_removed_and_nothing_else(tmp_path):
    kept = [_fake_checkpoint(tmp_path, "step-000004"), tmp_path / "notes.txt"]
    (tmp_path / "notes.txt").write_text("mine")
    debris = [
        _fake_checkpoint(tmp_path, "step-000006.tmp-1a2b3c4d", complete=False),
        _fake_checkpoint(tmp_path, "step-000004.old-1a2b3c4d"),
    ]
    assert sorted(remove_debris(tmp_path)) == sorted(debris)
    assert all(p.exists() for p in kept) and not any(p.exists() for p in debris)
    assert remove_debris(tmp_path / "missing") == []


# Two replicas of an interleaved PP 2 (non-uniform chunks), sharded and overlapped; and a plain
# 1F1B plan of as many ranks: one job runs both.
SHARDED = {
    **plan_dict(
        "tiny-llama",
        2,
        [
            {
                "count": 2,
                "micro_batches": 1,
                "virtual_stages": 2,
                "stages": [stage("nv", 1, [2, 2]), stage("nv", 1, [3, 1])],
            }
        ],
    ),
    "schedule": "interleaved-1f1b",
    "shard_optimizer": True,
    "overlap_grad_sync": True,
}
PLAIN_4 = plan_dict(
    "tiny-llama",
    2,
    [{"count": 1, "micro_batches": 2, "stages": [stage("nv", 1, 2)] * 4}],
)


@pytest.fixture(scope="module")
def sharded_jobs(tmp_path_factory):
    """A sharded interleaved run: 4 steps, saving after 2; a plain 1F1B plan resumes its step 2
    and saves after 4; the sharded plan then loads that."""
    root = tmp_path_factory.mktemp("sharded")
    sharded_dir, plain_dir = str(root / "sharded"), str(root / "plain")
    sharded, plain, back = job(
        root,
        [
            ("sharded", SHARDED, train(0, 1) + [("save", sharded_dir, 2)] + train(2, 3)),
            (
                "plain",
                PLAIN_4,
                [("load", str(step_dir(sharded_dir, 2)))] + train(2, 3) + [("save", plain_dir, 4)],
            ),
            ("sharded", SHARDED, [("load", str(step_dir(plain_dir, 4)))]),
        ],
    )
    return {
        "sharded": sharded,
        "plain": plain,
        "back": back,
        "saved2": read(step_dir(sharded_dir, 2)),
        "plain4": read(step_dir(plain_dir, 4)),
    }


@pytest.mark.slow
def test_a_sharded_interleaved_run_resumes_under_plain_1f1b_and_back(sharded_jobs):
    # the plain plan loaded the sharded run's full tensors, and trains on as it did
    assert_holds_shards(sharded_jobs["plain"], sharded_jobs["saved2"], "loaded", 2)
    for rank in sharded_jobs["plain"]:
        torch.testing.assert_close(
            rank["losses"], sharded_jobs["sharded"][0]["losses"][2:], rtol=1e-5, atol=0
        )
    # the sharded plan loads a plain checkpoint: every rank's whole state is the saved one
    assert_holds_shards(sharded_jobs["back"], sharded_jobs["plain4"], "loaded", 4)


@pytest.mark.slow
def test_a_checkpoint_written_before_the_fused_gemms_loads_as_its_fused_twin(jobs):
    # And one written before the sharded saves (every tensor whole) as its sharded twin.
    # Llama (grouped-query heads) on a TP 2 stage and a TP 1 one; GPT (fused biases too) on two
    # unlike replicas, TP 2 and TP 1: each rank's weights, moments and steps exactly as loaded
    # from the checkpoint the unfused one was made from.
    for run, kind in (("again", "unfused"), ("gpt_other", "unfused"), ("again", "whole")):
        for rank in jobs[run]:
            meta, state = rank[kind]
            assert meta == {"plan": "A", "step": 2}
            assert sorted(state) == sorted(rank["loaded"])
            for name, tensors in rank["loaded"].items():
                for got, want in zip(state[name], tensors, strict=True):
                    assert torch.equal(got, want), name
    torn = f"checkpoint {jobs['torn']} has no layers.0.v.weight"
    neither = (
        f"checkpoint {jobs['neither']} has no layers.0.qkv.weight (nor its parts before the "
        "fused GEMMs, layers.0.q.weight, layers.0.k.weight and layers.0.v.weight)"
    )
    why = ": it was written for another model"
    assert {tuple(rank["errors"][4:6]) for rank in jobs["again"]} == {(torn + why, neither + why)}
