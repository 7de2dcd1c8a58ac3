"""A run's checkpoint folders, without torch: which checkpoints are complete, the latest, the
older ones to remove, and what crashed saves left. hethub.runtime.checkpoint writes and reads
the folders' contents; the CLI asks these questions before any process starts, and must not pay
for importing torch.distributed.checkpoint to do so.

A checkpoint is complete exactly when its folder is named ``step-NNNNNN`` and holds meta.json
(hethub.runtime.checkpoint's atomic publish).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from hethub.errors import HethubError

META = "meta.json"
COMPLETE = re.compile(r"step-(\d+)")  # a published checkpoint's folder name, nothing more
DEBRIS = re.compile(r"step-\d+\.(tmp|old)-\w+")  # what a save that crashed can leave behind


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
    """The meta.json of the complete checkpoint at ``path``: its save's meta dict and "step".
    Pure filesystem (no process group). HethubError when it is missing or unfinished."""
    path = Path(path)
    if not path.is_dir():
        raise HethubError(f"checkpoint {path} does not exist")
    if not (path / META).is_file():
        raise HethubError(f"checkpoint {path} is incomplete: no {META} (its save did not finish)")
    try:
        return json.loads((path / META).read_text())
    except (OSError, ValueError) as error:
        raise HethubError(f"checkpoint {path} cannot be read: {error}") from error
