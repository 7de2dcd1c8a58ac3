"""Starting from a HuggingFace model on a prepared corpus, as the README's "Start from a
HuggingFace model" does with examples/hf/llama3-tiny: `hethub data prepare` with the model's own
tokenizer, then `hethub train --init-from` under a plan with TP 2 on one vendor's stage and TP 1
on the other's. A run resumed from its checkpoint over the memory-mapped, shuffled corpus gives
the unbroken run's losses bit for bit under its own plan, and (its data position kept in the
checkpoint) the same losses under another plan."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_train_cli import CLUSTER, hethub, records

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "hf" / "llama3-tiny"
PLAN = """model: {model}
global_batch: 4
micro_batch: 1
precision: fp32
pipelines:
  - count: 1
    micro_batches: 4
    stages:
      - {{group: nv, tp: 2, layers: 3}}
      - {{group: amd, tp: 1, layers: 1}}
"""
OTHER_PLAN = """model: {model}
global_batch: 4
micro_batch: 2
precision: fp32
pipelines:
  - count: 1
    micro_batches: 2
    stages:
      - {{group: amd, tp: 2, layers: 2}}
      - {{group: nv, tp: 1, layers: 2}}
"""
FLAGS = ["--seed", "3", "--lr", "1e-3", "--seq-len", "64", "--json", "--timeout", "60"]


def transformers_loss(corpus: Path) -> float:
    """transformers' mean token loss of the run's first global batch (seed 3, windows of 64)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hethub.corpus import open_corpus

    tokens = open_corpus(str(corpus)).batch(0, 4, 64, seed=3)
    model = AutoModelForCausalLM.from_pretrained(EXAMPLE, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=tokens[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item()


@pytest.mark.slow
def test_a_hf_model_trains_from_its_weights_and_resumes_over_a_prepared_corpus(tmp_path):
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    (tmp_path / "plan.yaml").write_text(PLAN.format(model=EXAMPLE))
    (tmp_path / "other.yaml").write_text(OTHER_PLAN.format(model=EXAMPLE))
    prepared = hethub(
        tmp_path, "data", "prepare", "--tokenizer", str(EXAMPLE), "--input", str(ROOT / "docs"),
        "--out", "corpus",
    )  # fmt: skip
    assert prepared.returncode == 0, prepared.stderr
    meta = json.loads((tmp_path / "corpus" / "metadata.json").read_text())
    assert meta["vocab"] == 512 and meta["dtype"] == "uint16" and meta["tokens"] > 10_000

    common = ["--cluster", "cluster.yaml", "--data", "corpus", "--init-from", str(EXAMPLE)]
    whole = hethub(
        tmp_path, "train", *common, "--plan", "plan.yaml", "--steps", "4",
        "--checkpoint-every", "2", "--run-dir", "runs/whole", *FLAGS,
    )  # fmt: skip
    assert whole.returncode == 0, whole.stderr
    steps, _ = records(whole)
    losses = [r["loss"] for r in steps]
    # Each step moves what the prediction's plan of transfers says (spec.collectives): TP 2 on
    # one vendor beside TP 1 on the other, a HF model's shapes.
    predicted = json.loads((tmp_path / "runs/whole/prediction.json").read_text())
    for record in steps:
        assert record["comm_bytes"] == predicted["comm_bytes"]
        assert record["comm_bytes_busiest_rank"] == predicted["comm_bytes_busiest_rank"]
    # The first step computes with the HF weights: transformers' own loss of that batch.
    assert losses[0] == pytest.approx(transformers_loss(tmp_path / "corpus"), rel=1e-5)
    assert losses[-1] < losses[0]
    settings = json.loads((tmp_path / "runs/whole/run.json").read_text())
    assert settings["init_from"] == str(EXAMPLE) and settings["seq_len"] == 64

    # The run as it stood after step 2: its checkpoint there, its first two steps' metrics.
    for name, plan in (("same", "plan.yaml"), ("other", "other.yaml")):
        half = tmp_path / "runs" / name
        shutil.copytree(tmp_path / "runs/whole", half)
        shutil.rmtree(half / "checkpoints" / "step-000004")
        position = json.loads((half / "checkpoints/step-000002/meta.json").read_text())
        assert position["data_position"] == 2 * 4  # two global batches of 4 sequences
        resumed = hethub(
            tmp_path, "train", "--resume", str(half), "--plan", plan, "--cluster",
            "cluster.yaml", "--steps", "4", "--json",
        )  # fmt: skip
        assert resumed.returncode == 0, resumed.stderr
        again = [r["loss"] for r in records(resumed)[0]]
        if name == "same":
            assert again == losses[2:]  # bit for bit
        else:
            assert again == pytest.approx(losses[2:], rel=1e-5)
