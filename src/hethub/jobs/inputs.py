"""A training job's inputs checked before anything is measured or started: the recipe, the
data and the validation data against the model and the batch, the run folder and the profiles'
folder (each refusal one line naming the input and the rule)."""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

from hethub.errors import HethubError
from hethub.profiles.selection import all_cpu
from hethub.report.terminal import plural
from hethub.runtime.checkpoint_folders import latest_checkpoint, latest_intact_checkpoint, read_meta
from hethub.runtime.rundir import RunDir, RunSettings
from hethub.spec import (
    ClusterSpec,
    ModelSpec,
)


def check_recipe(settings: RunSettings) -> None:
    """What the flags cannot check one by one: the floor of a decay is not above its peak, and
    --init-from names a folder."""
    if settings.min_lr is not None and settings.min_lr > settings.lr:
        raise HethubError(
            f"--min-lr = {settings.min_lr:g}: above --lr = {settings.lr:g}; a decay goes down "
            f"from --lr to --min-lr"
        )
    if settings.init_from is not None and not Path(settings.init_from).is_dir():
        raise HethubError(
            f"--init-from = {settings.init_from!r}: no such folder; give a HuggingFace model "
            f"folder (config.json and its .safetensors)"
        )


def check_run_dir(args: argparse.Namespace, default: Path, write: bool) -> None:
    """The run directory can be made, and is no other run's (under torchrun only the writing
    rank asks: the others may find the run.json it has just written)."""
    if not args.run_dir:
        check_folder(default.parent, f"{default.parent}/ (where runs go without --run-dir)")
        return
    given = shlex.quote(args.run_dir)
    check_folder(Path(args.run_dir), f"--run-dir = {args.run_dir!r}")
    run = RunDir(args.run_dir)
    if not write or not (run.path / "run.json").exists():
        return
    settings, done = run_state(run)
    if done is None:
        holds = (
            f"a run that stopped before its first checkpoint; start it again from step 0 "
            f"with --resume {given}"
        )
    elif done < settings.steps:
        holds = (
            f"a run stopped at step {done} of {settings.steps}; continue it with --resume {given}"
        )
    else:
        holds = (
            f"a finished run ({plural(done, 'step')}); train it further with --resume {given} "
            f"--steps N (N above {done})"
        )
    raise HethubError(f"--run-dir = {args.run_dir!r}: holds {holds}, or give another --run-dir")


def check_profiles_folder(args: argparse.Namespace, cluster: ClusterSpec, measure: bool) -> None:
    """Profiles measured here are written to --profiles: a folder, or one that can be made."""
    if measure and all_cpu(cluster):
        check_folder(Path(args.profiles), f"--profiles = {args.profiles!r}")


def check_folder(path: Path, named: str) -> None:
    """``path`` is a folder this process may write in, or one it can make: its nearest existing
    parent is a folder it may write in. Checked before anything is measured: a run that cannot
    be written finds out in a second, not after minutes of profiling."""
    if path.exists():
        if not path.is_dir():
            raise HethubError(f"{named}: is a file; give a folder (an existing one, or a new one)")
        if not os.access(path, os.W_OK | os.X_OK):
            raise HethubError(f"{named}: is a folder this user cannot write in; give another")
        return
    parent = next(p for p in path.absolute().parents if p.exists())
    if not parent.is_dir():
        raise HethubError(f"{named}: cannot be made, {parent} is a file and not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise HethubError(f"{named}: cannot be made, {parent} is not writable")


def make_run_dir(path: str) -> RunDir:
    """--run-dir's folder, made (checked already: this only fails when the disk changed since)."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise HethubError(f"--run-dir = {path!r}: cannot be made ({error.strerror})") from None
    return RunDir(path)


def check_data(settings: RunSettings, model: ModelSpec, global_batch: int) -> None:
    """Bad data (missing, of no known format, too short, out of the vocabulary) stops before
    any process starts: read from the corpus's metadata where it has some, never loaded whole."""
    from hethub.corpus import open_corpus

    open_corpus(settings.data).check(model.vocab, model.seq_len, global_batch)


def eval_sequences(settings: RunSettings, global_batch: int) -> int:
    """How many windows a run evaluates: --eval-sequences, else the global batch."""
    return settings.eval_sequences or global_batch


def check_eval_data(settings: RunSettings, model: ModelSpec, global_batch: int) -> None:
    """Held-out data that cannot fill the windows evaluated, or out of the model's vocabulary,
    stops before any process starts."""
    if settings.eval_data is None:
        return
    from hethub.corpus import open_corpus

    corpus = open_corpus(settings.eval_data, what="--eval-data")
    corpus.check(model.vocab, model.seq_len, eval_sequences(settings, global_batch))


def run_state(run: RunDir, verify_with=None) -> tuple[RunSettings, int | None]:
    """A run's settings, and the step of its latest complete checkpoint (None: it has none).
    With ``verify_with`` (a say), its latest intact one: each damaged newer one is moved aside and
    said in one line, and HethubError when every one is damaged
    (checkpoint_folders.latest_intact_checkpoint)."""
    settings = run.read_settings()
    if verify_with is None:
        checkpoint = latest_checkpoint(run.checkpoints)
    else:
        checkpoint = latest_intact_checkpoint(run.checkpoints, verify_with)
    return settings, None if checkpoint is None else read_meta(checkpoint)["step"]
