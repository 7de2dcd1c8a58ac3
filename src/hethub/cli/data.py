"""`hethub data prepare`: raw text tokenized into a folder that `--data` takes (Megatron-LM's
indexed format, with the tokenizer's files and a metadata file; hethub.corpus.prepare)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hethub.cli.args import positive_int
from hethub.report.terminal import progress_bar


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "data",
        help="prepare training data",
        description="Prepare training data for --data.",
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    prepare = actions.add_parser(
        "prepare",
        help="tokenize text, .jsonl and .parquet into a folder --data takes",
        description=(
            "Tokenize text files (one document each), folders of them, .jsonl (a document per "
            "line) and .parquet with a HuggingFace tokenizer into Megatron-LM's indexed format "
            "(DIR/tokens.bin + DIR/tokens.idx), with DIR/metadata.json and a copy of the "
            "tokenizer's files in DIR/tokenizer/. Each document is encoded as the tokenizer "
            "encodes it (its post-processor's special tokens included), then ends with EOS."
        ),
    )
    prepare.add_argument(
        "--tokenizer",
        required=True,
        metavar="TOK",
        help="a HuggingFace folder holding tokenizer.json, or a tokenizer.json",
    )
    prepare.add_argument(
        "--input",
        required=True,
        nargs="+",
        metavar="PATH",
        help="text files, folders of them, .jsonl and .parquet files, in the order given",
    )
    prepare.add_argument("--out", required=True, type=Path, metavar="DIR", help="a new folder")
    prepare.add_argument(
        "--field", default="text", help="the .jsonl field or .parquet column (default: text)"
    )
    prepare.add_argument(
        "--workers",
        type=positive_int,
        default=None,
        metavar="N",
        help="processes encoding at once (default: the cores this process may use)",
    )
    prepare.add_argument(
        "--eos",
        default=None,
        metavar="TOKEN",
        help="the token that ends each document (default: tokenizer_config.json's eos_token)",
    )
    prepare.set_defaults(run=run_prepare)


def run_prepare(args: argparse.Namespace) -> int:
    from hethub.corpus.prepare import prepare  # the tokenizers library: only for this command

    bar = progress_bar()
    try:
        prepared = prepare(
            args.tokenizer,
            args.input,
            args.out,
            field=args.field,
            workers=args.workers,
            eos=args.eos,
            progress=(
                (lambda done, total, tokens: bar.update("tokenizing", done, total, f"{tokens:,}"))
                if bar
                else None
            ),
        )
    finally:
        if bar:
            bar.close()
    print(prepared.summary())
    return 0
