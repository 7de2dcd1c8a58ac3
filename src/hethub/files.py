"""Writing files that another process (or a resumed run) may read at any moment."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file or the new one whole, never
    half of it: a crash mid-write, or a rank reading what another rank writes, leaves no torn file.

    The text goes to a uniquely named file in the same folder (os.replace is atomic only within
    one file system), which then replaces ``path``; two writers of one path never share the
    temporary file. On failure the temporary file is removed and the OSError raised.

    The file gets the mode open() would give it: 0666 less the user's umask (0644 under the usual
    022), so that a teammate on a shared file system reads a run as its owner does. tempfile's
    mkstemp would make it 0600, and os.umask cannot be read without setting it, which races with
    every thread that creates a file meanwhile: the kernel applies the umask to os.open's mode.
    """
    fd, temporary = _create_unique(path)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _create_unique(path: Path) -> tuple[int, Path]:
    """A new file beside ``path``, open for writing, created by this call alone (O_EXCL: 64
    random bits make a clash with another writer's name, or a crashed one's, all but
    impossible), with the mode the umask leaves of 0666."""
    temporary = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    return os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666), temporary
