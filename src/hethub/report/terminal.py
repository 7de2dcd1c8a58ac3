"""Output on a terminal or in a log: rich's bars and tables for a person watching, plain text for
a pipe, a file or CI, where a bar's redraws would be noise and a boxed table is hard to grep;
and the words for counts in what hethub prints."""

from __future__ import annotations

import io
import sys
from typing import TextIO

from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Table


def is_terminal(stream: TextIO) -> bool:
    """Whether a person watches ``stream``. Asked of the stream itself, not of rich: rich also
    says yes where FORCE_COLOR is set, as some CI runners do, whose logs want plain lines."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class ProgressBar:
    """A bar on a terminal, as wide as the terminal: phase, bar, done/total, time left, detail.

    A new phase starts the bar (and its estimate of the time left) anew: the planner's phases
    differ in length and speed. The bar is cleared on close, leaving the terminal to what
    follows it.
    """

    def __init__(self, stream: TextIO) -> None:
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=None),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[detail]}"),
            console=Console(file=stream, force_terminal=True),
            transient=True,
            expand=True,
        )
        self._task = None
        self._phase = None

    def update(self, phase: str, done: int, total: int, detail: str = "") -> None:
        if self._task is None:
            self._progress.start()
            self._task = self._progress.add_task(phase, total=total, completed=done, detail=detail)
        elif phase != self._phase:
            self._progress.reset(
                self._task, total=total, completed=done, description=phase, detail=detail
            )
        else:
            self._progress.update(self._task, total=total, completed=done, detail=detail)
        self._phase = phase

    def close(self) -> None:
        self._progress.stop()


def progress_bar(stream: TextIO | None = None) -> ProgressBar | None:
    """A bar on ``stream`` when a person watches it, else None: the caller logs plain lines or
    nothing. ``stream``: stderr (looked up at the call, so that a test's capture counts)."""
    stream = stream or sys.stderr
    return ProgressBar(stream) if is_terminal(stream) else None


def render_table(header: list[str], rows: list[list[str]], stream: TextIO | None = None) -> str:
    """The table as ``stream`` shows it best: drawn by rich on a terminal (at its width), plain
    columns padded to their widest cell elsewhere. Numbers (a column whose cells start with a
    digit) are right-aligned in both. ``stream``: where the table goes, stdout by default."""
    stream = stream or sys.stdout
    numeric = [
        all(str(cell)[:1].isdigit() for cell in column if str(cell)) and any(column)
        for column in zip(*rows)
    ] or [False] * len(header)
    if is_terminal(stream):
        return _rich_table(header, rows, numeric, stream)
    return _plain_table(header, rows, numeric)


def _rich_table(header: list[str], rows: list[list[str]], numeric: list[bool], stream) -> str:
    table = Table(
        box=box.SIMPLE_HEAD,
        header_style="bold",
        pad_edge=False,
        show_edge=False,
        collapse_padding=True,
    )
    for name, right in zip(header, numeric):
        table.add_column(name, justify="right" if right else "left")
    for row in rows:
        table.add_row(*map(str, row))
    # Rendered to text here, printed by the caller with the rest of its report. Never squeezed
    # to a narrow terminal: rich would cut figures with an ellipsis, or leave columns out; the
    # terminal wraps the lines instead, as it does plain text.
    terminal = Console(file=stream, force_terminal=True)
    natural = Measurement.get(terminal, terminal.options.update_width(10_000), table).maximum
    width = max(terminal.width, natural)
    buffer = io.StringIO()
    Console(file=buffer, force_terminal=True, width=width).print(table)
    return buffer.getvalue().rstrip("\n")


def _plain_table(header: list[str], rows: list[list[str]], numeric: list[bool]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            str(cell).rjust(width) if right else str(cell).ljust(width)
            for cell, width, right in zip(cells, widths, numeric)
        ).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``count`` and its noun, singular for one: "1 rank", "2 ranks", "3 processes" (``nouns``:
    the plural where adding an s is wrong)."""
    return f"{count:,} {noun if count == 1 else nouns or noun + 's'}"
