"""A checkpoint's manifest (every file's size and SHA-256 in its meta.json) and what a resume does
with it: a damaged checkpoint is found and named, moved aside (never deleted, never taken for a
checkpoint or for debris) and the newest intact one taken; none intact is one HethubError.
Hand-made folders, without torch; and a run whose workers, restarted after a failure, find the
newest checkpoint damaged. The resumes through `hethub train --resume` and the workers under the
user's torchrun are in tests/test_train_cli.py (they share its trained run)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from test_long_runs import COMMON, Training, folder, losses, uninterrupted

from hethub.errors import HethubError
from hethub.runtime.checkpoint_folders import (
    checkpoint_files,
    file_entry,
    keep_latest,
    latest_checkpoint,
    latest_intact_checkpoint,
    remove_debris,
    verify,
)

__all__ = ["folder", "uninterrupted"]  # test_long_runs' fixtures, used here

FILES = {
    ".metadata": b"index" * 10,
    "__0_0.distcp": bytes(range(256)) * 4,
    "sub/__1_0.distcp": b"x",
}


def _checkpoint(root: Path, step: int, listed: bool = True) -> Path:
    """A published checkpoint as checkpoint.save_checkpoint leaves it: its files, then its
    meta.json listing them (or, ``listed`` False, one written before the manifest)."""
    folder = root / f"step-{step:06d}"
    for name, data in FILES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    meta = {"plan": {}, "step": step}
    if listed:
        meta["files"] = [file_entry(folder, name) for name in checkpoint_files(folder)]
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def test_the_manifest_lists_every_file_with_its_size_and_sha256(tmp_path):
    folder = _checkpoint(tmp_path, 4)
    listed = json.loads((folder / "meta.json").read_text())["files"]
    assert [(e["path"], e["bytes"]) for e in listed] == sorted(
        (name, len(data)) for name, data in FILES.items()
    )
    # the SHA-256 of the bytes, as sha256sum gives it
    assert listed[1]["sha256"] == "785b0751fc2c53dc14a4ce3d800e69ef9ce1009eb327ccf458afe09c242c26c9"


def test_verify_names_the_file_and_what_differs(tmp_path):
    folder = _checkpoint(tmp_path, 4)
    assert verify(folder) is None
    data = folder / "__0_0.distcp"
    data.write_bytes(FILES["__0_0.distcp"][:100])  # truncated
    assert verify(folder) == f"{data} holds 100 bytes, its meta.json says 1024"
    flipped = bytearray(FILES["__0_0.distcp"])
    flipped[500] ^= 0xFF  # the same size, another byte
    data.write_bytes(bytes(flipped))
    assert (
        verify(folder)
        == f"{data} is not what was written (its sha256 differs from its meta.json's)"
    )
    data.unlink()
    assert verify(folder) == f"{data} is missing"
    (folder / "meta.json").write_text(json.dumps({"step": 4, "files": [{"path": "a"}]}))
    assert verify(folder) == f"checkpoint {folder}: the 'files' of its meta.json cannot be read"
    (folder / "meta.json").write_text('{"step": 4, "fil')  # a torn meta.json
    assert verify(folder).startswith(f"checkpoint {folder} cannot be read")


def test_a_checkpoint_written_before_the_manifest_is_taken_as_it_is(tmp_path):
    folder = _checkpoint(tmp_path, 4, listed=False)
    (folder / "__0_0.distcp").write_bytes(b"")  # nothing says what it held: not verifiable
    assert verify(folder) is None
    assert latest_intact_checkpoint(tmp_path, pytest.fail) == folder


def test_a_damaged_checkpoint_is_moved_aside_and_the_newest_intact_one_taken(tmp_path):
    intact = _checkpoint(tmp_path, 2)
    for step in (4, 6):
        _checkpoint(tmp_path, step)
    (tmp_path / "step-000004/__0_0.distcp").write_bytes(b"")
    (tmp_path / "step-000006/sub/__1_0.distcp").write_bytes(b"y")
    said: list[str] = []
    assert latest_intact_checkpoint(tmp_path, said.append) == intact
    aside = sorted(p.name for p in tmp_path.iterdir() if ".damaged-" in p.name)
    assert [name.split(".damaged-")[0] for name in aside] == ["step-000004", "step-000006"]
    kept_as = [tmp_path / name for name in aside]
    assert said == [  # newest first
        (
            f"checkpoint step-000006 is damaged ({tmp_path}/step-000006/sub/__1_0.distcp is not "
            "what was written (its sha256 differs from its meta.json's)): resuming from step 2 "
            f"instead; the damaged one is kept as {kept_as[1]}"
        ),
        (
            f"checkpoint step-000004 is damaged ({tmp_path}/step-000004/__0_0.distcp holds 0 "
            "bytes, its meta.json says 1024): resuming from step 2 instead; the damaged one is "
            f"kept as {kept_as[0]}"
        ),
    ]
    # Kept aside: no checkpoint, no debris, never removed by the clean-ups.
    assert latest_checkpoint(tmp_path) == intact
    assert remove_debris(tmp_path) == [] and keep_latest(tmp_path, 1) == []
    assert len([p for p in tmp_path.iterdir() if ".damaged-" in p.name]) == 2


def test_no_intact_checkpoint_is_one_error_and_moves_nothing(tmp_path):
    for step in (2, 4):
        (_checkpoint(tmp_path, step) / ".metadata").write_bytes(b"")
    with pytest.raises(HethubError) as refused:
        latest_intact_checkpoint(tmp_path, pytest.fail)
    assert str(refused.value) == (
        f"every checkpoint in {tmp_path} is damaged, none to resume from: "
        f"{tmp_path}/step-000004/.metadata holds 0 bytes, its meta.json says 50; "
        f"{tmp_path}/step-000002/.metadata holds 0 bytes, its meta.json says 50"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002", "step-000004"]
    assert latest_intact_checkpoint(tmp_path / "none", pytest.fail) is None


@pytest.mark.slow
def test_workers_restarted_after_a_failure_step_over_a_damaged_checkpoint(folder, uninterrupted):
    # 20 steps, a checkpoint every 2, the latest 3 kept (test_long_runs.COMMON)
    with Training(folder, "runs/restarted-damaged", *COMMON, "--max-restarts", "1") as run:
        run.wait_for("checkpoints/step-000004/meta.json")
        workers = run.workers()
        assert len(workers) == 2
        for pid in workers:  # no save publishes a newer checkpoint while the newest is damaged
            os.kill(pid, signal.SIGSTOP)
        newest = latest_checkpoint(folder / "runs/restarted-damaged/checkpoints")
        shard = min(newest.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:100])
        os.kill(workers[-1], signal.SIGKILL)  # rank 1 fails: torchrun restarts both
        os.kill(workers[0], signal.SIGCONT)
        code, stderr = run.finish()
    assert code == 0, stderr
    assert "died of SIGKILL; restarting the workers" in stderr and "Traceback" not in stderr
    said = [line for line in stderr.splitlines() if " is damaged " in line]
    step = int(newest.name.removeprefix("step-"))
    assert len(said) == 1 and f"{newest.name}/{shard.name} holds 100 bytes" in said[0], stderr
    assert f"resuming from step {step - 2} instead" in said[0]
    assert losses(folder / "runs/restarted-damaged") == uninterrupted  # bit for bit
    assert len(list(newest.parent.glob(f"{newest.name}.damaged-*"))) == 1
