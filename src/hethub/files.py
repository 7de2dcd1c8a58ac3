"""Writing files that another process (or a resumed run) may read at any moment."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file or the new one whole, never
    half of it: a crash mid-write, or a rank reading what another rank writes, leaves no torn file.

    The text goes to a uniquely named file in the same folder (os.replace is atomic only within
    one file system), which then replaces ``path``; two writers of one path never share the
    temporary file. On failure the temporary file is removed and the OSError raised.
    """
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
