"""hethub's messages to the user, through logging: one logger per command ("hethub.train",
"hethub.profile", ...; "hethub" itself for messages of no command), each message one line on
stderr as "hethub COMMAND: message". Every command's -q shows only warnings and errors, -v adds
debug lines (set_verbosity); a user's own handler on the "hethub" logger (a file, a service's
log) receives them all. The one-line error contract stays the CLI's: an error is one line, exit
status 2, no traceback (cli.main).

The handler writes to the stderr of the moment, not the one at its making, so that a caller
that swaps sys.stderr (a test's capture, a notebook) gets the lines."""

from __future__ import annotations

import logging
import sys

ROOT = "hethub"
VERBOSITY_LEVELS = {-1: logging.WARNING, 0: logging.INFO, 1: logging.DEBUG}
"""-q, nothing, -v: the "hethub" logger's level."""


class _Stderr(logging.StreamHandler):
    """A handler on the stderr of the moment, its lines as "hethub COMMAND: message"."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(_CommandFormatter())

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:  # StreamHandler sets it; the moment's is used instead
        pass


class _CommandFormatter(logging.Formatter):
    """ "hethub.train" and a message -> "hethub train: message"."""

    def format(self, record: logging.LogRecord) -> str:
        return f"{record.name.replace('.', ' ', 1)}: {record.getMessage()}"


def logger(command: str | None = None) -> logging.Logger:
    """The logger of ``command`` (None: hethub's own), its messages on stderr unless the user
    has configured otherwise."""
    root = logging.getLogger(ROOT)
    if not any(isinstance(h, _Stderr) for h in root.handlers):
        root.addHandler(_Stderr())
        root.setLevel(VERBOSITY_LEVELS[0])
        root.propagate = False  # one line, not again through the user's root handlers
    return root if command is None else logging.getLogger(f"{ROOT}.{command}")


def set_verbosity(verbosity: int) -> None:
    """-q (-1), nothing (0) or -v (1): which of hethub's messages are shown."""
    logger().setLevel(VERBOSITY_LEVELS[max(-1, min(1, verbosity))])
