"""`hethub train` through real torchrun: the same losses as the single-process reference, the run
directory it writes, resuming (bit for bit, and under another plan), and its clear errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_engine import BF16_LOSS_RTOL, LOSS_MOVES_BY_TOLERANCES

from hethub.corpus import open_corpus
from hethub.runtime.model import Stage
from hethub.runtime.precision import MasterWeights
from hethub.spec import load_model

CLUSTER = """groups:
  - {name: nv, accelerator: a100-80gb, nodes: 1, devices_per_node: 2}
  - {name: amd, accelerator: mi250x, nodes: 1, devices_per_node: 2}
"""
PLAN = """model: tiny-llama
global_batch: 4
micro_batch: 1
precision: fp32
pipelines:
  - count: 1
    micro_batches: 4
    stages:
      - {group: nv, tp: 1, layers: 5}
      - {group: amd, tp: 1, layers: 3}
"""
# Resumed under another layout: two replicas of an interleaved pipeline over both vendors, chunks
# of 2 + 3 and 2 + 1 layers, its optimizer sharded over the replicas, its sync overlapped.
OTHER_PLAN = """model: tiny-llama
global_batch: 4
micro_batch: 1
precision: fp32
schedule: interleaved-1f1b
shard_optimizer: true
overlap_grad_sync: true
pipelines:
  - count: 2
    virtual_stages: 2
    stages:
      - {group: nv, tp: 1, layers: [2, 3]}
      - {group: amd, tp: 1, layers: [2, 1]}
"""


def reference_losses(steps: int, seed: int, lr: float, precision: str = "fp32") -> list[float]:
    """One process, the whole model, the runtime's recipe for ``precision`` with `hethub
    train`'s defaults but a constant rate (RECIPE_FLAGS): torch's AdamW with weight decay 0.1
    on all but norms (a no-decay group), gradients clipped at norm 1."""
    spec = load_model("tiny-llama")
    model = Stage.build(spec, 0, spec.layers, None, is_first=True, is_last=True, seed=seed)
    weights = MasterWeights(model, precision)
    decayed = [p for _, p in weights.named if p.dim() > 1]
    norms = [p for _, p in weights.named if p.dim() == 1]
    optimizer = torch.optim.AdamW(
        [{"params": decayed, "weight_decay": 0.1}, {"params": norms, "weight_decay": 0.0}], lr=lr
    )
    corpus, losses = open_corpus(None), []
    for step in range(steps):
        tokens = corpus.batch(step * 4, 4, spec.seq_len, seed)
        weights.zero_grad()
        loss = model.loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(weights.parameters(), 1.0)
        optimizer.step()
        weights.copy_to_model()
        losses.append(loss.item())
    return losses


def hethub(cwd, *args, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "hethub", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def records(done) -> tuple[list[dict], dict]:
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    return lines[:-1], lines[-1]


def _write_files(folder: Path) -> Path:
    (folder / "cluster.yaml").write_text(CLUSTER)
    (folder / "plan.yaml").write_text(PLAN)
    (folder / "other.yaml").write_text(OTHER_PLAN)
    return folder


@pytest.fixture
def files(tmp_path):
    return _write_files(tmp_path)


# A constant rate: these runs are resumed with more --steps than they started with, which
# stretches a decaying schedule (a cosine decays to --min-lr at the run's last step).
RECIPE_FLAGS = ["--lr-schedule", "constant"]
WHOLE_FLAGS = ["--seed", "3", "--lr", "1e-3", *RECIPE_FLAGS, "--json", "--timeout", "60"]


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    """One uninterrupted fp32 run of PLAN, 4 steps, a checkpoint after every step and the latest
    2 kept: (its folder, the finished `hethub train --json`). Every launch costs ~25 s of process
    starts on a 2-core machine, so the tests that need such a run read this one (and copy it
    before they change it)."""
    folder = _write_files(tmp_path_factory.mktemp("whole"))
    done = hethub(
        folder,
        "train",
        "--cluster",
        "cluster.yaml",
        "--plan",
        "plan.yaml",
        "--steps",
        "4",
        "--checkpoint-every",
        "1",
        "--keep-checkpoints",
        "2",
        "--run-dir",
        "runs/whole",
        *WHOLE_FLAGS,
    )
    return folder, done


@pytest.mark.slow
def test_train_matches_the_reference_and_resumes_bit_for_bit_and_under_another_plan(
    files, whole_run
):
    common = WHOLE_FLAGS
    folder, whole = whole_run
    assert whole.returncode == 0, whole.stderr
    steps, final = records(whole)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    losses = [r["loss"] for r in steps]
    assert losses == pytest.approx(reference_losses(4, 3, 1e-3), rel=1e-5)
    # The stage boundary crosses vendors, every step; the exact figure is the plan of
    # transfers', below.
    assert all(r["comm_bytes"]["bridge"] > 0 for r in steps)
    # every step moves, rank by rank and path by path, what the prediction's plan of transfers
    # says (spec.collectives), and the busiest rank what it says of one rank
    predicted = json.loads((folder / "runs" / "whole" / "prediction.json").read_text())
    for record in steps:
        assert record["comm_bytes"] == predicted["comm_bytes"]
        assert record["comm_bytes_busiest_rank"] == predicted["comm_bytes_busiest_rank"]
    assert {r["precision"] for r in steps} == {"fp32"}
    assert final["world_size"] == 2 and "loss" not in final
    assert [r["group"] for r in final["ranks"]] == ["nv", "amd"]
    run = folder / "runs" / "whole"
    for name in (
        "plan.yaml",
        "cluster.yaml",
        "run.json",
        "prediction.json",
        "metrics.jsonl",
        "trace.json",
        "loss.png",
        "checkpoints/step-000004/meta.json",
    ):
        assert (run / name).exists(), name
    assert [
        json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
    ] == losses
    sources = {
        e["args"]["name"].split(" · ")[0]
        for e in json.loads((run / "trace.json").read_text())["traceEvents"]
        if e["name"] == "process_name"
    }
    assert sources == {"predicted", "measured"}

    half = hethub(
        files,
        "train",
        "--cluster",
        "cluster.yaml",
        "--plan",
        "plan.yaml",
        "--steps",
        "2",
        "--run-dir",
        "runs/half",
        *[flag for flag in common if flag != "--json"],
    )
    assert half.returncode == 0, half.stderr
    # Piped, as in CI or a log: one plain line per step, the figures users grep for.
    logged = [line for line in half.stderr.splitlines() if line.startswith("hethub train: step ")]
    assert [line.split(":")[1].strip() for line in logged] == ["step 1/2", "step 2/2"]
    assert all(
        "loss " in line and " tokens/s | step " in line and "(predicted " in line for line in logged
    )
    assert "\x1b[" not in half.stderr + half.stdout  # no bar, no colour
    resumed = hethub(files, "train", "--resume", "runs/half", "--steps", "4", "--json")
    assert resumed.returncode == 0, resumed.stderr
    assert [r["loss"] for r in records(resumed)[0]] == losses[2:]  # bit for bit
    assert [
        json.loads(line)["step"]
        for line in (files / "runs/half/metrics.jsonl").read_text().splitlines()
    ] == [1, 2, 3, 4]

    other = hethub(
        files,
        "train",
        "--resume",
        "runs/half",
        "--plan",
        "other.yaml",
        "--cluster",
        "cluster.yaml",
        "--steps",
        "6",
        "--json",
    )
    assert other.returncode == 0, other.stderr
    assert [r["loss"] for r in records(other)[0]] == pytest.approx(
        reference_losses(6, 3, 1e-3)[4:], rel=1e-5
    )
    final_other = records(other)[1]
    assert final_other["world_size"] == 4
    # fp32 AdamW keeps its two moments, 8 bytes a parameter; sharded over the 2 replicas, 8 / 2
    # (it steps its shard of the weights themselves, no copy): over all ranks, as much as the
    # unsharded run's (two ranks, one copy each)
    whole_state = sum(r["optimizer_state_bytes"] for r in final["ranks"])
    sharded_state = sum(r["optimizer_state_bytes"] for r in final_other["ranks"])
    assert sharded_state == pytest.approx(whole_state, rel=1e-3)
    assert (files / "runs/half/plan.before-step-4.yaml").read_text() != (
        files / "runs/half/plan.yaml"
    ).read_text()


@pytest.mark.slow
def test_a_bf16_run_trains_in_bf16_and_resumes_bit_for_bit(files):
    (files / "plan.yaml").write_text(PLAN.replace("precision: fp32", "precision: bf16"))
    common = ["--cluster", "cluster.yaml", "--plan", "plan.yaml", "--seed", "3", "--lr", "1e-3"]
    common += [*RECIPE_FLAGS, "--json", "--timeout", "60"]
    whole = hethub(files, "train", *common, "--steps", "4", "--run-dir", "runs/whole")
    assert whole.returncode == 0, whole.stderr
    steps = records(whole)[0]
    losses = [r["loss"] for r in steps]
    assert {r["precision"] for r in steps} == {"bf16"}
    bf16, fp32 = reference_losses(4, 3, 1e-3, "bf16"), reference_losses(4, 3, 1e-3)
    # The reference's loss falls 7% in these steps, far beyond the tolerance: a run whose weights
    # never moved could not match it.
    assert (bf16[0] - bf16[-1]) / bf16[0] > LOSS_MOVES_BY_TOLERANCES * BF16_LOSS_RTOL, bf16
    assert losses == pytest.approx(bf16, rel=BF16_LOSS_RTOL)
    # It did compute in bf16: the first step (the same weights everywhere) is the bf16
    # reference's, and not fp32's (they differ by ~1e-5 here; layouts in fp32 by < 1e-6).
    assert losses[0] == pytest.approx(bf16[0], rel=1e-6)
    assert losses[0] != pytest.approx(fp32[0], rel=1e-6)
    half = hethub(files, "train", *common, "--steps", "2", "--run-dir", "runs/half")
    assert half.returncode == 0, half.stderr
    resumed = hethub(files, "train", "--resume", "runs/half", "--steps", "4", "--json")
    assert resumed.returncode == 0, resumed.stderr
    # the bf16 weights are made again from the fp32 masters the checkpoint holds
    assert [r["loss"] for r in records(resumed)[0]] == losses[2:]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--cluster", "cluster.yaml", "--plan", "missing.yaml"], "missing.yaml"),
        (["--plan", "plan.yaml"], "--plan needs --cluster"),
        (["--resume", "runs/nothing"], "not a run directory"),
        (["--cluster", "cluster.yaml", "--plan", "plan.yaml", "--steps", "0"], "--steps = 0"),
        (
            ["--cluster", "cluster.yaml", "--plan", "plan.yaml", "--data", "no-such.txt"],
            "no such file",
        ),
    ],
)
def test_bad_input_is_one_clear_line_before_any_process_starts(files, args, message):
    done = hethub(files, "train", *args, timeout=60)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (files / "runs").exists()  # nothing written


def test_a_plan_that_does_not_match_the_cluster_is_refused_before_any_process_starts(files):
    (files / "plan.yaml").write_text(PLAN.replace("group: amd", "group: intel"))
    done = hethub(files, "train", "--cluster", "cluster.yaml", "--plan", "plan.yaml", timeout=60)
    assert (
        done.returncode == 2 and "no such group" in done.stderr and "Traceback" not in done.stderr
    )


def test_resume_refuses_a_run_that_is_done_and_a_run_without_checkpoints(files):
    run = files / "runs" / "empty"
    run.mkdir(parents=True)
    (run / "run.json").write_text(
        json.dumps(
            {
                "seed": 0,
                "lr": 1e-3,
                "data": None,
                "steps": 4,
                "checkpoint_every": 2,
                "timeout_s": 60,
            }
        )
    )
    done = hethub(files, "train", "--resume", "runs/empty", timeout=60)
    assert done.returncode == 2 and "no complete checkpoint" in done.stderr


def _workers_of(folder: Path, run_dir: str) -> list[int]:
    """The pids of the torchrun workers training ``run_dir`` in ``folder`` (torchrun gives them
    their own session). Matched by working folder too: another test run on this machine may
    train a run directory of the same name."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
            cwd = os.readlink(entry / "cwd")
        except OSError:  # not a process, gone, or not ours to read
            continue
        is_agent = b"torch.distributed.run" in command  # torchrun carries the workers' arguments
        if (
            not is_agent
            and cwd == str(folder.resolve())
            and b"hethub.runtime.worker" in command
            and any(p.endswith(run_dir.encode()) for p in command)
        ):
            pids.append(int(entry.name))
    return pids


@pytest.mark.slow
def test_a_run_keeps_its_latest_checkpoints_and_clears_crash_debris_on_resume(files, whole_run):
    # The whole run: 4 steps, --checkpoint-every 1 --keep-checkpoints 2.
    folder, done = whole_run
    assert done.returncode == 0, done.stderr
    checkpoints = folder / "runs/whole/checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000003", "step-000004"]
    # Resumed in a copy: the other tests read the whole run as it finished.
    shutil.copytree(folder / "runs/whole", files / "runs/kept")
    checkpoints = files / "runs/kept/checkpoints"
    debris = checkpoints / "step-000005.tmp-deadbeef"  # a save that crashed
    debris.mkdir()
    resumed = hethub(files, "train", "--resume", "runs/kept", "--steps", "5", "--json")
    assert resumed.returncode == 0, resumed.stderr
    # the resume keeps --keep-checkpoints 2 from run.json, and the debris is gone
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000004", "step-000005"]


def _damaged_copy(folder: Path, whole_run, name: str) -> tuple[Path, list[float]]:
    """A copy of the whole run (checkpoints at steps 3 and 4) as runs/NAME in ``folder``, and the
    uninterrupted run's losses."""
    source, whole = whole_run
    assert whole.returncode == 0, whole.stderr
    shutil.copytree(source / "runs/whole", folder / "runs" / name)
    return folder / "runs" / name / "checkpoints", [r["loss"] for r in records(whole)[0]]


def _shards(checkpoint: Path) -> list[Path]:
    """The checkpoint's tensor files, one a rank (DCP's __RANK_N.distcp)."""
    return sorted(checkpoint.glob("*.distcp"))


def _assert_resumed_from_step_3(done, checkpoints: Path, damaged: str, losses: list[float]):
    """The resume of a run whose step-4 checkpoint is damaged: step 4 again from step 3, as the
    uninterrupted run trained it, one line naming the file, and the damaged folder kept aside."""
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    said = [line for line in done.stderr.splitlines() if " is damaged " in line]
    assert len(said) == 1, done.stderr
    assert f"step-000004/{damaged}" in said[0] and "resuming from step 3 instead" in said[0]
    assert [r["loss"] for r in records(done)[0]] == losses[3:]  # bit for bit
    metrics = (checkpoints.parent / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["loss"] for line in metrics] == losses
    (aside,) = checkpoints.glob("step-000004.damaged-*")
    assert (aside / damaged).is_file() and (checkpoints / "step-000004/meta.json").is_file()


@pytest.mark.slow
def test_resume_steps_over_a_truncated_checkpoint_to_the_one_before(files, whole_run):
    checkpoints, losses = _damaged_copy(files, whole_run, "cut")
    shard = _shards(checkpoints / "step-000004")[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    resumed = hethub(files, "train", "--resume", "runs/cut", "--steps", "4", "--json")
    _assert_resumed_from_step_3(resumed, checkpoints, shard.name, losses)


@pytest.mark.slow
def test_workers_under_torchrun_step_over_a_checkpoint_with_flipped_bytes(files, whole_run):
    # The workers pick their checkpoint themselves (as after an automatic restart): rank 0
    # verifies. Run as torchrun runs them, on the run's own settings (4 steps).
    checkpoints, losses = _damaged_copy(files, whole_run, "flipped")
    shard = _shards(checkpoints / "step-000004")[-1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 8] = bytes(b ^ 0xFF for b in data[len(data) // 2 :][:8])
    shard.write_bytes(bytes(data))  # the same size, other bytes
    resumed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + ["-m", "hethub.runtime.worker", "runs/flipped", "--resume", "--json"],
        cwd=files,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    _assert_resumed_from_step_3(resumed, checkpoints, shard.name, losses)


def test_resume_with_no_intact_checkpoint_is_one_line_and_exit_2(files, whole_run):
    checkpoints, _ = _damaged_copy(files, whole_run, "ruined")
    for step in (3, 4):
        (checkpoints / f"step-{step:06d}" / ".metadata").write_bytes(b"")
    done = hethub(files, "train", "--resume", "runs/ruined", "--steps", "6", timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    (line,) = done.stderr.splitlines()
    assert (
        line.startswith("hethub train: error: every checkpoint in ")
        and "step-000003/.metadata" in line
    )
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000003", "step-000004"]


GPT_PLAN = PLAN.replace("tiny-llama", "tiny-gpt")


def _legacy_and_truncated(checkpoints: Path) -> tuple[list[str], str]:
    """Step 4 as written before the manifest (nothing to verify it by), a file cut short."""
    meta = json.loads((checkpoints / "step-000004/meta.json").read_text())
    del meta["files"]
    (checkpoints / "step-000004/meta.json").write_text(json.dumps(meta))
    shard = _shards(checkpoints / "step-000004")[-1]
    shard.write_bytes(shard.read_bytes()[:1000])
    return ["--steps", "6"], "step-000004 cannot be loaded (rank 1: "  # then torch's reason


def _other_model(checkpoints: Path) -> tuple[list[str], str]:
    """A GPT resumed from the Llama's checkpoint."""
    (checkpoints.parents[2] / "gpt.yaml").write_text(GPT_PLAN)
    return ["--plan", "gpt.yaml", "--steps", "6"], "it was written for another model"


@pytest.mark.slow
@pytest.mark.parametrize("cause", [_legacy_and_truncated, _other_model])
def test_an_error_that_would_repeat_is_said_once_and_never_restarted(files, whole_run, cause):
    # Every rank refuses the load, and every attempt would.
    checkpoints, _ = _damaged_copy(files, whole_run, "again")
    flags, error = cause(checkpoints)
    done = hethub(files, "train", "--resume", "runs/again", *flags)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and error in errors[0], done.stderr
    assert "restart" not in done.stderr
    agent = (files / "runs/again/logs/agent.log").read_text()
    assert "will restart worker group" not in agent
