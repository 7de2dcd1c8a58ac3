"""The `hethub` command: one subcommand per module in this package."""

from __future__ import annotations

import sys

from hethub import __version__
from hethub.cli import catalog, plan, predict, profile, train, validate
from hethub.cli.args import ArgumentParser
from hethub.errors import HethubError

COMMANDS = (train, validate, plan, predict, profile, catalog)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="hethub",
        description="Train large language models on clusters that mix accelerator kinds.",
    )
    parser.add_argument("--version", action="version", version=f"hethub {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; bad input is one line on stderr and exit status 2, never a traceback."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # argparse's: a bad flag (said in one line), --help or --version
        return exit_.code
    try:
        return args.run(args)
    except HethubError as error:
        print(f"hethub {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"hethub {args.command}: interrupted", file=sys.stderr)
        return 130
