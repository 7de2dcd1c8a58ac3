"""The one error type a user sees: bad input, said in one line."""

from __future__ import annotations

from typing import Any


class HethubError(Exception):
    """An error in what the user gave us (a file, a flag, a plan).

    The CLI prints it as one line and exits with status 2; it never shows a traceback.
    """


class SpecError(HethubError):
    """A field of an input file breaks a rule.

    The message names the file, the field, the offending value and the rule, e.g.
    ``cluster.yaml: groups[0].nodes = 0: must be a positive integer``.
    """

    def __init__(self, source: str, field: str, value: Any, rule: str) -> None:
        self.source, self.field, self.value, self.rule = source, field, value, rule
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{field} = {value!r}: {rule}")
