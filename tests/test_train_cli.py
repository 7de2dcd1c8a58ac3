"""`hethub train` through real torchrun: the same losses as the single-process reference."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hethub.runtime.data import builtin_corpus, global_batch
from hethub.runtime.model import Stage, full_state
from hethub.spec import load_model

CLUSTER = """groups:
  - {name: nv, accelerator: a100-80gb, nodes: 1, devices_per_node: 2}
  - {name: amd, accelerator: mi250x, nodes: 1, devices_per_node: 2}
"""
PLAN = """model: tiny-llama
global_batch: 4
micro_batch: 1
pipelines:
  - count: 1
    micro_batches: 4
    stages:
      - {group: nv, tp: 1, layers: 5}
      - {group: amd, tp: 1, layers: 3}
"""


def reference_losses(steps: int, seed: int, lr: float) -> list[float]:
    spec = load_model("tiny-llama")
    model = Stage(spec, 0, spec.layers, None, is_first=True, is_last=True)
    model.load_full(full_state(spec, seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    corpus, losses = builtin_corpus(), []
    for step in range(steps):
        tokens = global_batch(corpus, step, 4, spec.seq_len, seed)
        loss = model.loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_train_under_torchrun_matches_the_reference(tmp_path):
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    (tmp_path / "plan.yaml").write_text(PLAN)
    done = subprocess.run([sys.executable, "-m", "hethub", "train", "--cluster", "cluster.yaml", "--plan", "plan.yaml",
                           "--steps", "2", "--seed", "3", "--json", "--timeout", "60"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    steps, final = records[:-1], records[-1]
    assert [r["step"] for r in steps] == [1, 2]
    assert [r["loss"] for r in steps] == pytest.approx(reference_losses(2, 3, 1e-3), rel=1e-5)
    assert steps[-1]["comm_bytes"]["bridge"] > 0  # the stage boundary crosses vendors
    assert final["world_size"] == 2 and "loss" not in final
    assert [r["group"] for r in final["ranks"]] == ["nv", "amd"]


def test_a_plan_that_does_not_match_the_cluster_is_refused_before_any_process_starts(tmp_path):
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    (tmp_path / "plan.yaml").write_text(PLAN.replace("group: amd", "group: intel"))
    done = subprocess.run([sys.executable, "-m", "hethub", "train", "--cluster", "cluster.yaml", "--plan", "plan.yaml"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "no such group" in done.stderr and "Traceback" not in done.stderr
