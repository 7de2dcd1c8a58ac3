"""`hethub export`: a run's checkpoint as a HuggingFace model folder, which transformers, vLLM
and lm-eval load as they are.

RUN/checkpoints' newest intact checkpoint (or --step's) is read a shard's worth of parameters at
a time, whatever plan wrote it (runtime.hf_checkpoint.export_checkpoint), and written as
safetensors shards of at most --max-shard-size with their index, beside config.json (the run's
model as transformers names it: spec.hf_config), generation_config.json and, where the run's data
is a folder `hethub data prepare` wrote, its tokenizer's files.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from hethub.cli.args import non_negative_int
from hethub.errors import HethubError
from hethub.messages import logger
from hethub.report.terminal import plural
from hethub.runtime.checkpoint_folders import (
    latest_intact_checkpoint,
    read_meta,
    verify,
)
from hethub.runtime.rundir import RunDir, RunSettings
from hethub.spec import load_model, load_plan
from hethub.spec.model import ModelSpec

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}
"""--max-shard-size's units: decimal, as transformers' ("5GB")."""


def byte_size(text: str) -> int:
    """argparse type= of --max-shard-size: bytes, or a number with KB, MB or GB (decimal)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B)?\s*", text, re.IGNORECASE)
    value = int(float(match[1]) * UNITS[(match[2] or "").upper()]) if match else 0
    if value <= 0:
        raise argparse.ArgumentTypeError(
            f"= {text}: must be a positive size in bytes, or with KB, MB or GB (e.g. 5GB)"
        )
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "export",
        help="write a run's checkpoint as a HuggingFace model folder",
        description="Write RUN's newest intact checkpoint (or --step's) as a HuggingFace model "
        "folder: config.json, generation_config.json, safetensors shards with their index, and "
        "the tokenizer's files when the run's data was prepared with one. It reads one shard's "
        "worth of weights at a time.",
    )
    parser.add_argument("run_dir", metavar="RUN", help="the run folder (runs/<name>)")
    parser.add_argument("--out", required=True, help="the folder to write (new or empty)")
    parser.add_argument(
        "--step",
        type=non_negative_int,
        help="the checkpoint of this step (default: the newest intact one)",
    )
    parser.add_argument(
        "--dtype", choices=("bf16", "fp32"), default="bf16", help="the weights' dtype (bf16)"
    )
    parser.add_argument(
        "--max-shard-size",
        type=byte_size,
        default="5GB",
        metavar="SIZE",
        help="the largest safetensors file, e.g. 5GB (the default), 500MB",
    )
    parser.set_defaults(run=run)


def run_checkpoint(run_dir: Path, step: int | None) -> tuple[ModelSpec, Path, RunSettings]:
    """A run folder's model (as it trained: its sequence length too), the checkpoint to read
    (--step's, or the newest intact one) and its settings. HethubError, in one line, for a
    folder that is no run or has no intact checkpoint."""
    run = RunDir(run_dir)
    if not (run.path / "run.json").is_file():
        raise HethubError(f"{run.path}: not a run folder (no run.json in it)")
    settings = run.read_settings()
    plan = load_plan(run.plan)
    spec = load_model(
        plan.model, relative_to=run.path, source=str(run.plan), seq_len=settings.seq_len
    )
    if step is not None:
        path = run.checkpoints / f"step-{step:06d}"
        read_meta(path)  # HethubError: missing or unfinished
        problem = verify(path)
        if problem is not None:
            raise HethubError(f"checkpoint {path} is damaged: {problem}")
        return spec, path, settings
    path = latest_intact_checkpoint(run.checkpoints, _say)
    if path is None:
        raise HethubError(f"{run.path}: no checkpoint in {run.checkpoints}, nothing to export")
    return spec, path, settings


def _say(message: str) -> None:
    logger("export").info(message)


def tokenizer_files(data: str | None) -> tuple[Path | None, dict]:
    """The tokenizer folder of a run's data where it is a folder `hethub data prepare` wrote
    (DIR/tokenizer/), and its metadata.json (eos, bos); (None, {}) for any other data."""
    if data is None:
        return None, {}
    folder = Path(data)
    tokenizer, metadata = folder / "tokenizer", folder / "metadata.json"
    if not (tokenizer.is_dir() and metadata.is_file()):
        return None, {}
    try:
        return tokenizer, json.loads(metadata.read_text())
    except (OSError, ValueError) as error:
        raise HethubError(f"{metadata}: cannot be read ({error})") from None


def _empty_out(out: Path) -> None:
    """Create ``out``, refusing one that holds anything: an export never mixes with old files."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise HethubError(f"--out = {str(out)!r}: exists and is not an empty folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise HethubError(f"--out = {str(out)!r}: cannot be created ({error.strerror})") from None


def write_configs(out: Path, spec: ModelSpec, dtype: str, tokens: dict) -> None:
    """config.json and generation_config.json of the export of ``spec`` in ``dtype`` (a
    torch dtype's name), with the special tokens of the run's data (``tokens``: its
    metadata.json) where known."""
    from hethub.spec.hf_config import hf_config_from_model

    special = {"bos_token_id": tokens.get("bos"), "eos_token_id": tokens.get("eos")}
    config = {**hf_config_from_model(spec), "torch_dtype": dtype, **special}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {key: value for key, value in special.items() if value is not None}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def run(args: argparse.Namespace) -> int:
    spec, checkpoint, settings = run_checkpoint(Path(args.run_dir), args.step)
    tokenizer, tokens = tokenizer_files(settings.data)
    out = Path(args.out)
    _empty_out(out)
    # torch only now: the checks above answer without it
    from hethub.runtime.hf_checkpoint import DTYPES, HF_DTYPE_NAMES, export_checkpoint

    dtype = DTYPES[args.dtype]
    written = export_checkpoint(checkpoint, spec, out, dtype, args.max_shard_size)
    write_configs(out, spec, HF_DTYPE_NAMES[dtype], tokens)
    copied = []
    if tokenizer is not None:
        for file in sorted(tokenizer.iterdir()):
            if file.is_file():
                shutil.copy2(file, out / file.name)
                copied.append(file.name)
    step = read_meta(checkpoint)["step"]
    said = f"; tokenizer: {', '.join(copied)}" if copied else ""
    print(
        f"exported step {step} of {args.run_dir} to {out}: "
        f"{plural(len(written), 'file')} of weights ({args.dtype}){said}"
    )
    return 0
