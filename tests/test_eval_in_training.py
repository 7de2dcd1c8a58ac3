"""Validation under a run's own plan: Engine.evaluate, forward only through the same pipeline
(TP mixed across vendors, unlike replicas, interleaved chunks, ZBV's V, sequence parallelism),
against the single-process reference's loss on the same windows; and `hethub train --eval-data`
writing eval_loss into metrics.jsonl with each step's lr and grad_norm."""

from __future__ import annotations

import json

import pytest
import torch
from test_engine import CLUSTER, batches, stage

from hethub.runtime.lr_schedule import lr_at
from hethub.runtime.model import Stage
from hethub.runtime.rundir import RunDir
from hethub.spec import load_model, parse_plan
from hethub.spec.topology import build_topology

SEED = 7
WINDOWS = 7
"""Not a multiple of the micro-batch: the last micro-batch is smaller."""


def plan(model, pipelines, **fields):
    return {
        "model": model,
        "micro_batch": 2,
        "precision": "fp32",
        "global_batch": 2 * sum(p["count"] * p.get("micro_batches", 1) for p in pipelines),
        "pipelines": pipelines,
        **fields,
    }


PLANS = {
    "two stages, tp 2 then 1 across vendors, and an unlike replica": plan(
        "tiny-llama",
        [
            {"count": 1, "micro_batches": 3, "stages": [stage("nv", 2, 3), stage("amd", 1, 5)]},
            {"count": 1, "micro_batches": 1, "stages": [stage("amd", 1, 8)]},
        ],
    ),
    "interleaved, tp 2 with sequence parallelism on both vendors, tied head": plan(
        "tiny-gpt",
        [
            {
                "count": 1,
                "micro_batches": 2,
                "virtual_stages": 2,
                "stages": [stage("nv", 2, [1, 3]), stage("amd", 2, [2, 2])],
            }
        ],
        schedule="interleaved-1f1b",
        sequence_parallel=True,
    ),
    "zbv over pp 3, tp 2 on one stage": plan(
        "tiny-llama",
        [
            {
                "count": 1,
                "micro_batches": 2,
                "stages": [stage("nv", 1, [1, 2]), stage("amd", 2, [1, 1]), stage("nv", 1, [2, 1])],
            }
        ],
        schedule="zbv",
    ),
}


def windows(spec) -> torch.Tensor:
    """WINDOWS windows (n, seq_len + 1) of Zipf-drawn tokens."""
    return torch.cat(batches(spec, WINDOWS))[:WINDOWS]


def reference_loss(preset: str) -> float:
    """One process, the whole model: the mean token loss of the windows, in one forward."""
    spec = load_model(preset)
    model = Stage.build(spec, 0, spec.layers, None, is_first=True, is_last=True, seed=SEED)
    tokens = windows(spec)
    with torch.no_grad():
        return model.loss(model(tokens[:, :-1]), tokens[:, 1:]).item()


def _rank(rank, world, plans):
    from hethub.runtime.engine import Engine

    out = []
    for plan_dict in plans:
        spec, parsed = load_model(plan_dict["model"]), parse_plan(plan_dict)
        topology = build_topology(parsed, CLUSTER)
        engine = Engine.for_job(parsed, topology, spec, CLUSTER, seed=SEED)
        before = dict(engine.comm.bytes)
        loss = engine.evaluate(windows(spec))
        held_grads = any(p.grad is not None for p in engine.stage.parameters())
        out.append((loss, engine.comm.bytes == before, held_grads))
    return out


@pytest.mark.slow
def test_evaluate_is_the_reference_loss_under_every_schedule_on_every_rank():
    from hethub.runtime.spawn import run_ranks

    plans = list(PLANS.values())
    assert {build_topology(parse_plan(p), CLUSTER).world_size for p in plans} == {4}
    results = run_ranks(_rank, 4, plans, timeout_s=240, purpose="test")
    for p, (name, plan_dict) in enumerate(PLANS.items()):
        want = reference_loss(plan_dict["model"])
        losses = {rank[p][0] for rank in results}
        assert len(losses) == 1, name  # the same float on every rank
        assert losses.pop() == pytest.approx(want, rel=1e-6), name
        for _, uncounted, held_grads in (rank[p] for rank in results):
            assert uncounted and not held_grads, name


@pytest.mark.slow
def test_train_with_eval_data_logs_eval_loss_lr_and_grad_norm(tmp_path):
    from test_train_cli import CLUSTER as CLUSTER_YAML
    from test_train_cli import PLAN, hethub, records

    (tmp_path / "cluster.yaml").write_text(CLUSTER_YAML)
    (tmp_path / "plan.yaml").write_text(PLAN)
    (tmp_path / "held-out.txt").write_text("Held-out text, read as bytes. " * 200)
    done = hethub(
        tmp_path,
        "train",
        "--cluster",
        "cluster.yaml",
        "--plan",
        "plan.yaml",
        "--steps",
        "3",
        "--eval-data",
        "held-out.txt",
        "--eval-every",
        "2",
        "--eval-sequences",
        "3",
        "--run-dir",
        "runs/eval",
        "--json",
        "--timeout",
        "60",
    )
    assert done.returncode == 0, done.stderr
    steps, _ = records(done)
    assert [("eval_loss" in r) for r in steps] == [False, True, True]  # every 2 and the last
    # a cross entropy, and a gradient, of weights that learn: measured, no figure to match
    assert all(r["eval_loss"] > 0 for r in steps if "eval_loss" in r)
    assert all(r["grad_norm"] > 0 for r in steps)
    recipe = RunDir(tmp_path / "runs/eval").read_settings()
    assert [r["lr"] for r in steps] == [lr_at(step, recipe) for step in range(3)]
    settings = json.loads((tmp_path / "runs/eval/run.json").read_text())
    assert settings["eval_every"] == 2 and settings["eval_sequences"] == 3
    assert settings["eval_data"] == str((tmp_path / "held-out.txt").resolve())
