"""hethub.report.terminal: rich's bars and tables on a terminal, plain text in a log."""

from __future__ import annotations

import io
import re

from hethub.report.terminal import progress_bar, render_table


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


HEADER = ["stage", "group", "tp", "memory GB"]
ROWS = [["0", "nv", "1", "12.5 / 80"], ["1", "amd", "16", "3.0 / 64"]]


def test_a_table_in_a_log_is_plain_columns_with_numbers_right_aligned():
    assert render_table(HEADER, ROWS, io.StringIO()).splitlines() == [
        "stage  group  tp  memory GB",
        "-----  -----  --  ---------",
        "    0  nv      1  12.5 / 80",
        "    1  amd    16   3.0 / 64",
    ]


def test_a_table_on_a_narrow_terminal_keeps_every_figure_whole(monkeypatch):
    monkeypatch.setenv("COLUMNS", "20")  # the table needs 29
    text = re.sub(r"\x1b\[[0-9;]*m", "", render_table(HEADER, ROWS, Terminal()))
    assert "\x1b" not in text and "…" not in text
    lines = text.splitlines()
    assert lines[0].split() == ["stage", "group", "tp", "memory", "GB"]
    assert lines[2].split() == ["0", "nv", "1", "12.5", "/", "80"]
    assert lines[3].endswith(" 3.0 / 64")  # right-aligned under its header


def test_progress_bar_on_a_terminal_and_none_in_a_log():
    assert progress_bar(io.StringIO()) is None  # piped: the caller logs plain lines or nothing
    # rich redraws ten times a second; the last state is drawn on close, then cleared.
    stream = Terminal()
    bar = progress_bar(stream)
    bar.update("search", 0, 4)
    bar.update("search", 4, 4, "best 1,234 tokens/s")
    bar.close()
    text = stream.getvalue()
    assert "search" in text and "4/4" in text and "best 1,234 tokens/s" in text
    assert text.endswith("\x1b[2K")  # cleared: the terminal is left to what follows
    stream = Terminal()
    bar = progress_bar(stream)
    bar.update("search", 3, 4)
    bar.update("refine", 1, 8)  # a new phase: the bar, and its estimate of the time left, anew
    bar.close()
    assert "refine" in stream.getvalue() and "1/8" in stream.getvalue()
