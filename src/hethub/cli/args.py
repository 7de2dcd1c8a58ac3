"""What every `hethub` command's flags share: the parser, and the checks argparse runs on values."""

from __future__ import annotations

import argparse
import re


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, its errors said in one line as hethub says its own: the usage is
    two lines of flags that hide the one that is wrong (--help has them all)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        # positive_int's message starts "= value": "argument --top: = 0: ..." reads
        # "--top = 0: ...", the form of a file's field ("plan.yaml: micro_batch = 0: ...").
        message = re.sub(r"^argument (\S+): = ", r"\1 = ", message)
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive_int(text: str) -> int:
    """argparse type= of a count (steps, batch sizes, parallel degrees): an integer above 0."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"= {text}: must be a positive integer")
    return value
