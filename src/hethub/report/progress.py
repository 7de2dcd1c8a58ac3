"""A one-line progress bar on a terminal."""

from __future__ import annotations

import time
from typing import TextIO


class ProgressBar:
    """Redraws one line: phase, a bar, a count and an optional detail; at most ten times a second."""

    def __init__(self, stream: TextIO, width: int = 30) -> None:
        self.stream, self.width, self._last, self._drawn = stream, width, 0.0, 0

    def update(self, phase: str, done: int, total: int, detail: str = "") -> None:
        now = time.monotonic()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        filled = int(self.width * done / total) if total else self.width
        line = (
            f"\r{phase[:32]:<32} [{'#' * filled}{'.' * (self.width - filled)}] "
            f"{100 * done // max(total, 1):3d}%" + (f" {detail}" if detail else "")
        )
        self.stream.write(line.ljust(self._drawn))
        self._drawn = len(line)
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\r" + " " * self._drawn + "\r")
        self.stream.flush()
