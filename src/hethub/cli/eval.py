"""`hethub eval`: the mean next-token loss of a model on held-out data, from a HuggingFace folder
or a run's checkpoint.

One process builds the whole model as one stage (runtime.model.Stage, first and last, no TP
group) in fp32 and fills it parameter by parameter from the HF files (each tensor read once) or
from the DCP checkpoint (read straight into the stage's parameters, whatever plan wrote it):
for models that fit one host's memory. Its windows are consecutive from the start of the data,
in document order: window i is tokens [i L, i L + L], its first L tokens the input and its last
L the targets (corpus.consecutive), scored a few windows at a time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import warnings
from pathlib import Path

from hethub.cli.args import non_negative_int, positive_int
from hethub.cli.export import run_checkpoint
from hethub.errors import HethubError
from hethub.spec import load_model
from hethub.spec.model import ModelSpec, with_seq_len

DEFAULT_SEQUENCES = 64
"""Windows evaluated where --sequences is not given."""
WINDOWS_AT_ONCE = 8
"""Windows one forward scores: the activations of a few, never of all."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "eval",
        help="the mean next-token loss of a HF model folder or a run's checkpoint on data",
        description="The mean next-token loss of SOURCE, a HuggingFace model folder or a run "
        "folder (its newest intact checkpoint, or --step's), on windows of --data taken "
        "consecutively from its start. It runs the whole model in one process, in fp32: for "
        "models that fit this host's memory.",
    )
    parser.add_argument("source", metavar="SOURCE", help="a HF model folder or a run folder")
    parser.add_argument("--data", required=True, help="the data (as hethub train's --data)")
    parser.add_argument(
        "--seq-len", type=positive_int, help="tokens a window (default: the model's)"
    )
    parser.add_argument(
        "--sequences",
        type=positive_int,
        default=DEFAULT_SEQUENCES,
        help=f"windows to score, fewer where the data ends (default {DEFAULT_SEQUENCES})",
    )
    parser.add_argument(
        "--step", type=non_negative_int, help="a run's checkpoint of this step (default: newest)"
    )
    parser.add_argument("--json", action="store_true", help='print {"loss", "tokens"}')
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    source = Path(args.source)
    if (source / "run.json").is_file():
        spec, checkpoint, _ = run_checkpoint(source, args.step)
        hf = None
        if args.seq_len is not None:  # the positions it trained stay its longest
            longest = spec.max_position_embeddings or spec.seq_len
            spec = with_seq_len(
                dataclasses.replace(spec, max_position_embeddings=longest),
                args.seq_len,
                "",
                "--seq-len",
            )
    elif (source / "config.json").is_file():
        if args.step is not None:
            raise HethubError(f"--step = {args.step}: {source} is a HuggingFace folder, not a run")
        spec, checkpoint, hf = load_model(source, seq_len=args.seq_len), None, source
    else:
        raise HethubError(
            f"{source}: neither a run folder (run.json) nor a HuggingFace model folder "
            "(config.json)"
        )
    loss, tokens = evaluate(spec, args.data, args.sequences, hf=hf, checkpoint=checkpoint)
    if args.json:
        print(json.dumps({"loss": loss, "tokens": tokens}))
    else:
        print(f"loss {loss:.6f} over {tokens:,} tokens ({spec.name}, windows of {spec.seq_len})")
    return 0


def evaluate(
    spec: ModelSpec,
    data: str,
    sequences: int,
    *,
    hf: Path | None = None,
    checkpoint: Path | None = None,
) -> tuple[float, int]:
    """The mean next-token loss of ``spec``'s weights from the HF folder ``hf`` or the DCP
    ``checkpoint`` on the first ``sequences`` consecutive windows of ``data``, and the number of
    tokens it scored."""
    import torch

    from hethub.corpus import open_corpus

    corpus = open_corpus(data)
    corpus.check(spec.vocab, spec.seq_len, 1)
    windows = corpus.consecutive(0, sequences, spec.seq_len)  # (n, L + 1)
    if len(windows) == 0:
        raise HethubError(
            f"--data = {data!r}: shorter than one window of {spec.seq_len + 1} tokens"
        )
    stage = whole_model(spec, hf=hf, checkpoint=checkpoint)
    total = 0.0
    with torch.no_grad():
        for batch in windows.split(WINDOWS_AT_ONCE):
            loss = stage.loss(stage(batch[:, :-1]), batch[:, 1:])
            total += loss.item() * len(batch)
    return total / len(windows), len(windows) * spec.seq_len


def whole_model(spec: ModelSpec, *, hf: Path | None, checkpoint: Path | None):
    """The whole model as one fp32 stage in this process, its weights from the HF folder
    ``hf`` or the DCP ``checkpoint``."""
    import torch
    import torch.distributed.checkpoint as dcp

    from hethub.runtime.hf_checkpoint import HfWeights, check_checkpoint_model
    from hethub.runtime.model import Stage

    weights = HfWeights(hf, spec) if hf is not None else None  # checked before any allocation
    stage = Stage.build(spec, 0, spec.layers, None, is_first=True, is_last=True, seed=0)
    params = dict(stage.full_parameters())
    if weights is not None:
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(weights.parameter(name))
        return stage
    targets = {f"model/{name}": param.detach() for name, param in params.items()}
    check_checkpoint_model(checkpoint, spec)
    with warnings.catch_warnings():  # DCP warns that it reads in one process: it is meant to
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(targets, checkpoint_id=checkpoint, no_dist=True)  # into the parameters
    return stage
