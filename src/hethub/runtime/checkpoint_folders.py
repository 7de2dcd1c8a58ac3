"""A run's checkpoint folders, without torch: which checkpoints are complete, the latest, the
older ones to remove, and what crashed saves left. hethub.runtime.checkpoint writes and reads
the folders' contents; the CLI asks these questions before any process starts, and must not pay
for importing torch.distributed.checkpoint to do so.

A checkpoint is complete exactly when its folder is named ``step-NNNNNN`` and holds meta.json
(hethub.runtime.checkpoint's atomic publish). It is intact when it also holds exactly what its
meta.json's manifest lists (``files``: every other file's path, size and SHA-256, written before
the publish), and a resume takes the newest intact one (latest_intact_checkpoint), moving each
damaged newer one aside as ``step-NNNNNN.damaged-<token>``: kept for the user, never deleted, and
no checkpoint, debris or candidate to anything here. Checkpoints written before the manifest
cannot be verified; they count as intact, as they did when they were written.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from hethub.errors import HethubError

META = "meta.json"
COMPLETE = re.compile(r"step-(\d+)")  # a published checkpoint's folder name, nothing more
DEBRIS = re.compile(r"step-\d+\.(tmp|old)-\w+")  # what a save that crashed can leave behind
MANIFEST = "files"
"""meta.json's list of the checkpoint's files: {"path", "bytes", "sha256"} each, path relative to
the checkpoint's folder, meta.json itself aside."""
CHECKSUM = "sha256"
"""hashlib's name of the manifest's checksum. SHA-256 rather than BLAKE2b: current x86 and Arm
server CPUs hash it in hardware (SHA-NI, the Armv8 crypto extension), 1.9 GB/s against BLAKE2b's
1.3 GB/s in software on the machine this was written on, and `sha256sum` checks it by hand."""


def keep_latest(checkpoints_dir: Path, keep: int) -> list[Path]:
    """Remove the complete checkpoints older than the latest ``keep`` (at least 1: the latest is
    never removed); the folders removed. Rank 0 only, after a checkpoint is published."""
    done = sorted(_complete(Path(checkpoints_dir)), key=lambda found: found[0])
    old = [folder for _, folder in done[: max(len(done) - max(keep, 1), 0)]]
    for folder in old:
        shutil.rmtree(folder)
    return old


def remove_debris(checkpoints_dir: Path) -> list[Path]:
    """Remove what saves that crashed left in ``checkpoints_dir`` (``step-N.tmp-*``, written but
    never published, and ``step-N.old-*``, stepped aside for a replacement); the folders
    removed. Only when no save runs: at the start of a run or a resume, on rank 0."""
    root = Path(checkpoints_dir)
    debris = [d for d in root.iterdir() if DEBRIS.fullmatch(d.name)] if root.is_dir() else []
    for folder in debris:
        shutil.rmtree(folder)
    return debris


def checkpoint_files(folder: Path) -> list[str]:
    """The paths of the files in the checkpoint ``folder`` (meta.json aside), relative to it,
    sorted: what its manifest lists, a file_entry each (hethub.runtime.checkpoint shares the
    hashing out among the ranks)."""
    folder = Path(folder)
    found = (p for p in folder.rglob("*") if p.is_file() and p.name != META)
    return sorted(p.relative_to(folder).as_posix() for p in found)


def file_entry(folder: Path, name: str) -> dict:
    """The manifest's entry of file ``name`` in ``folder``: its path, size and checksum."""
    with open(Path(folder) / name, "rb") as file:
        size = os.fstat(file.fileno()).st_size  # of the file opened: fresh on a network FS
        digest = hashlib.file_digest(file, CHECKSUM).hexdigest()
    return {"path": name, "bytes": size, CHECKSUM: digest}


def verify(path: Path) -> str | None:
    """What makes the complete checkpoint at ``path`` unusable, said for the user (a file
    missing, of another size or another checksum than its manifest says, or the manifest itself
    unreadable), or None: intact, or written before the manifest (which cannot be verified).
    Sizes are compared first, so that a truncated file is found without reading the others."""
    path = Path(path)
    try:
        listed = _meta_json(path).get(MANIFEST)
    except HethubError as error:
        return str(error)
    if listed is None:
        return None  # written before the manifest: complete is all that can be known
    try:
        entries = [(e["path"], int(e["bytes"]), str(e[CHECKSUM])) for e in listed]
    except (TypeError, KeyError, ValueError):
        return f"checkpoint {path}: the {MANIFEST!r} of its {META} cannot be read"
    for name, size, _ in entries:
        file = path / name
        found = file.stat().st_size if file.is_file() else None
        if found is None:
            return f"{file} is missing"
        if found != size:
            return f"{file} holds {found} bytes, its {META} says {size}"
    for name, _, checksum in entries:
        if file_entry(path, name)[CHECKSUM] != checksum:
            return (
                f"{path / name} is not what was written (its {CHECKSUM} differs from its {META}'s)"
            )
    return None


def latest_intact_checkpoint(checkpoints_dir: Path, say: Callable[[str], None]) -> Path | None:
    """The newest complete checkpoint in ``checkpoints_dir`` that verifies (None: none there);
    each damaged newer one is moved aside (``step-NNNNNN.damaged-<token>``), said in one line
    through ``say`` that names its damage and the step resumed from instead. Rank 0 (or the host
    that starts the job), when no save runs. HethubError, moving nothing, when there are
    checkpoints and every one is damaged: there is nothing to resume from."""
    done = sorted(_complete(Path(checkpoints_dir)), key=lambda found: found[0], reverse=True)
    damaged = []
    for step, folder in done:
        problem = verify(folder)
        if problem is None:
            for old, old_problem in damaged:
                aside = old.with_name(f"{old.name}.damaged-{uuid.uuid4().hex[:8]}")
                os.replace(old, aside)
                say(
                    f"checkpoint {old.name} is damaged ({old_problem}): resuming from step "
                    f"{step} instead; the damaged one is kept as {aside}"
                )
            return folder
        damaged.append((folder, problem))
    if damaged:
        raise HethubError(
            f"every checkpoint in {checkpoints_dir} is damaged, none to resume from: "
            + "; ".join(problem for _, problem in damaged)
        )
    return None


def latest_checkpoint(checkpoints_dir: Path) -> Path | None:
    """The complete checkpoint of the highest step in ``checkpoints_dir`` (None: none there).
    Unfinished saves (``*.tmp-*``, or any folder without meta.json) are never candidates."""
    done = _complete(Path(checkpoints_dir))
    return max(done, key=lambda found: found[0])[1] if done else None


def _complete(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint in ``root``."""
    if not root.is_dir():
        return []
    return [
        (int(m.group(1)), d)
        for d in root.iterdir()
        if (m := COMPLETE.fullmatch(d.name)) and (d / META).is_file()
    ]


def read_meta(path: Path) -> dict:
    """The meta.json of the complete checkpoint at ``path``: its save's meta dict and "step"
    (the manifest of its files aside). Pure filesystem (no process group). HethubError when it is
    missing or unfinished."""
    return {key: value for key, value in _meta_json(path).items() if key != MANIFEST}


def _meta_json(path: Path) -> dict:
    """The whole meta.json of the complete checkpoint at ``path``; HethubError as read_meta."""
    path = Path(path)
    if not path.is_dir():
        raise HethubError(f"checkpoint {path} does not exist")
    if not (path / META).is_file():
        raise HethubError(f"checkpoint {path} is incomplete: no {META} (its save did not finish)")
    try:
        return json.loads((path / META).read_text())
    except (OSError, ValueError) as error:
        raise HethubError(f"checkpoint {path} cannot be read: {error}") from error
