"""Plain-text tables for the terminal."""

from __future__ import annotations


def render_table(header: list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest cell; numbers (cells starting with a digit) right-aligned."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]

    def line(cells: list[str]) -> str:
        out = []
        for cell, width in zip(cells, widths):
            cell = str(cell)
            out.append(cell.rjust(width) if cell[:1].isdigit() else cell.ljust(width))
        return "  ".join(out).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])
