"""The `hethub` command: one subcommand per module in this package."""

from __future__ import annotations

import argparse
import os
import sys

from hethub import __version__
from hethub.cli import catalog, data, export, launch, plan, predict, profile, train, validate
from hethub.cli import eval as eval_command  # a builtin's name
from hethub.cli.args import ArgumentParser
from hethub.errors import HethubError
from hethub.messages import logger, set_verbosity
from hethub.runtime.torch_support import installed_torch, require_supported_torch

COMMANDS = (train, launch, validate, plan, predict, profile, catalog, data, eval_command, export)
NEED_TORCH = {"train", "launch", "validate", "profile", "eval", "export"}
"""The commands that run torch (their workers too: they start as `hethub train`; launch checks the
training data as train does); an unsupported torch stops them in one line before any torch code
runs. plan, predict and catalog never load it."""
READER_GONE = 141
"""Exit status when stdout's reader has gone (`hethub predict --json | head`): what a shell
reports for a Unix tool that SIGPIPE ends (128 + 13), so a pipeline under `set -o pipefail`
reads it as such; 1 is taken by validate's verdict and 2 by bad input."""


class VersionAction(argparse.Action):
    """--version: hethub's version and the installed torch's, with the accelerator it is built
    for. torch is imported only when asked, not by every command that builds the parser."""

    def __init__(self, option_strings: list[str], dest: str, **_: object) -> None:
        super().__init__(
            option_strings,
            dest=argparse.SUPPRESS,
            default=argparse.SUPPRESS,
            nargs=0,
            help="print hethub's version, torch's and the accelerator torch is built for",
        )

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        print(f"hethub {__version__} ({installed_torch()})")
        parser.exit()


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="hethub",
        description="Train large language models on clusters that mix accelerator kinds.",
    )
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    for command_parser in sub.choices.values():
        loudness = command_parser.add_mutually_exclusive_group()
        loudness.add_argument(
            "-q", "--quiet", action="store_const", const=-1, dest="verbosity", default=0,
            help="say only warnings and errors",
        )  # fmt: skip
        loudness.add_argument(
            "-v", "--verbose", action="store_const", const=1, dest="verbosity",
            help="say debug lines too",
        )  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; bad input is one line on stderr and exit status 2, never a traceback. A
    reader of stdout that leaves early ends the command quietly (READER_GONE)."""
    try:
        code = _run(argv)
        sys.stdout.flush()  # output that fit in the buffer meets the closed pipe here
        return code
    except BrokenPipeError:
        # Python's advice (the signal module's docs, "Note on SIGPIPE"): point stdout at devnull
        # so that the interpreter's last flush at exit raises nothing more.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return READER_GONE


def _run(argv: list[str] | None) -> int:
    """Parse the flags and run the command; its exit status."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # argparse's: a bad flag (said in one line), --help or --version
        return exit_.code
    set_verbosity(args.verbosity)
    say = logger(args.command)
    try:
        if args.command in NEED_TORCH:
            require_supported_torch()
        return args.run(args)
    except HethubError as error:
        say.error(f"error: {error}")
        return 2
    except KeyboardInterrupt:
        say.error("interrupted")
        return 130
