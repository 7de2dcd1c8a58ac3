"""What every `hethub` command's flags share: the parser, and the checks argparse runs on values."""

from __future__ import annotations

import argparse
import datetime
import math
import re

from hethub.jobs.prepare import DEFAULT_GLOBAL_BATCH, DEFAULT_MODEL
from hethub.profiles.machine import PROFILES_ENV, default_profiles_dir
from hethub.runtime.lr_schedule import MIN_LR_SHARE, WARMUP_SHARE, LrSchedule
from hethub.runtime.rundir import DEFAULT_SETTINGS


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


def non_negative_int(text: str) -> int:
    """argparse type= of a count that may be 0 (restarts)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"= {text}: must be an integer of 0 or more")
    return value


SEEDS = 2**32
"""--seed takes 0 .. SEEDS - 1, the usual range of a seed (numpy's): the runtime seeds torch's
generators with seed x 1,000,003 + step, which must stay within 64 bits (10**23 did not)."""
LONGEST_TIMEOUT = datetime.timedelta(days=365)
"""--timeout's ceiling. Far longer ones overflow torch's and gloo's clock arithmetic: on torch 2.13
a worker failed at 1e10 s ("Invalid timeout"), and hung at 9e9 s; a year is far from both and
longer than any collective should wait."""


def seed(text: str) -> int:
    """argparse type= of --seed: an integer from 0 to SEEDS - 1."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < SEEDS:
        raise argparse.ArgumentTypeError(f"= {text}: must be an integer from 0 to {SEEDS - 1}")
    return value


def positive_finite_float(text: str) -> float:
    """argparse type= of a rate (--lr): a number above 0, neither nan nor infinite."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"= {text}: must be a positive finite number")
    return value


def non_negative_finite_float(text: str) -> float:
    """argparse type= of a rate or a bound that may be 0 (--weight-decay, --min-lr,
    --clip-grad): a number of 0 or more, neither nan nor infinite."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"= {text}: must be a finite number of 0 or more")
    return value


def timeout_seconds(text: str) -> float:
    """argparse type= of --timeout: seconds above 0, at most LONGEST_TIMEOUT."""
    value = positive_finite_float(text)
    longest = LONGEST_TIMEOUT.total_seconds()
    if value > longest:
        raise argparse.ArgumentTypeError(
            f"= {text}: must be at most {longest:.0f} seconds ({LONGEST_TIMEOUT.days} days)"
        )
    return value


def node(text: str) -> tuple[str, int]:
    """argparse type= of --this-node: GROUP:INDEX, a group's name and one of its nodes from 0 (that
    the cluster has them is checked once it is read: hethub.runtime.nodes)."""
    group, _, index = text.rpartition(":")
    if not group.strip() or not index.isdigit():
        raise argparse.ArgumentTypeError(
            f"= {text}: must be GROUP:INDEX, a group of the cluster file and the index of "
            f"this node among the group's, from 0 (e.g. gpu:0)"
        )
    return group, int(index)


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that say what to train and where."""
    parser.add_argument(
        "--cluster",
        help="cluster YAML file (default: examples/clusters/local-hetero.yaml, "
        "two emulated kinds of device on this machine)",
    )
    parser.add_argument(
        "--plan", help="plan YAML file (default: the planner's plan for the cluster)"
    )
    parser.add_argument(
        "--model", help=f"model preset or YAML when planning (default {DEFAULT_MODEL})"
    )
    parser.add_argument(
        "--global-batch",
        type=positive_int,
        help=f"sequences per step when planning (default {DEFAULT_GLOBAL_BATCH})",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        help=f"optimizer steps in total (default {DEFAULT_SETTINGS.steps}; on --resume, the run's)",
    )
    parser.add_argument(
        "--seed",
        type=seed,
        help=f"seed of the weights and the batches (default {DEFAULT_SETTINGS.seed})",
    )
    parser.add_argument(
        "--lr",
        type=positive_finite_float,
        help=f"AdamW learning rate (default {DEFAULT_SETTINGS.lr:g})",
    )
    add_recipe_arguments(parser)
    parser.add_argument(
        "--data",
        help="a text file, a folder of text files, or a .bin of uint16 tokens "
        "(default: the standard library's pydoc texts)",
    )
    add_eval_arguments(parser)
    parser.add_argument(
        "--run-dir",
        help="the run's directory (default runs/<plan or cluster name>, "
        "with -2, -3, ... when taken)",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=positive_int,
        help="checkpoint every K steps and at the end "
        f"(default {DEFAULT_SETTINGS.checkpoint_every})",
    )
    parser.add_argument(
        "--keep-checkpoints",
        type=positive_int,
        help="complete checkpoints kept, the latest ones "
        f"(default {DEFAULT_SETTINGS.keep_checkpoints}: a step back past a bad one, "
        "and bounded disk)",
    )
    parser.add_argument(
        "--profiles",
        default=str(default_profiles_dir()),
        help=f"this machine's profiles, measured there when missing (default ${PROFILES_ENV}, "
        f"else this machine's folder in the user's cache: {default_profiles_dir()})",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per step on stdout")
    parser.add_argument(
        "--timeout",
        type=timeout_seconds,
        help=f"seconds a collective may wait for a peer (default {DEFAULT_SETTINGS.timeout_s:g})",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="launch even when the plan needs more memory or processes than this machine has "
        "(the pre-flight check; refused without it)",
    )


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    """The training recipe's flags beside --lr (runtime.lr_schedule, runtime.optimizer,
    runtime.grad_norm), the starting weights and the sequence length. On --resume, each is the
    run's unless given again."""
    parser.add_argument(
        "--weight-decay",
        metavar="DECAY",
        type=non_negative_finite_float,
        help="AdamW's decoupled weight decay, on every parameter but norms and biases "
        f"(default {DEFAULT_SETTINGS.weight_decay:g})",
    )
    parser.add_argument(
        "--warmup-steps",
        metavar="STEPS",
        type=non_negative_int,
        help="steps of linear warm-up of the learning rate "
        f"(default {100 * WARMUP_SHARE:g}%% of the run's steps, rounded)",
    )
    parser.add_argument(
        "--lr-schedule",
        choices=[schedule.value for schedule in LrSchedule],
        help="after the warm-up: a cosine or linear decay to --min-lr at the last step, or a "
        f"constant rate (default {DEFAULT_SETTINGS.lr_schedule})",
    )
    parser.add_argument(
        "--min-lr",
        metavar="LR",
        type=non_negative_finite_float,
        help=f"the rate a decay reaches at the last step (default {MIN_LR_SHARE:g} x --lr)",
    )
    parser.add_argument(
        "--clip-grad",
        metavar="NORM",
        type=non_negative_finite_float,
        help="clip the gradients' global norm to this, 0 for no clipping "
        f"(default {DEFAULT_SETTINGS.clip_grad:g})",
    )
    parser.add_argument(
        "--init-from",
        metavar="DIR",
        help="start from the weights of a HuggingFace folder (config.json and safetensors) "
        "instead of the seeded initialisation",
    )
    parser.add_argument(
        "--seq-len",
        metavar="L",
        type=positive_int,
        help="tokens per sequence (default: the model's; a HuggingFace model's "
        "max_position_embeddings, at most 4096, which also bounds it)",
    )


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """Validation during training: held-out data, run forward through the run's own plan."""
    parser.add_argument(
        "--eval-data",
        metavar="D",
        help="held-out data to compute a validation loss on (as --data takes; default: none)",
    )
    parser.add_argument(
        "--eval-every",
        metavar="K",
        type=positive_int,
        help="evaluate every K steps and at the last (default: at every checkpoint)",
    )
    parser.add_argument(
        "--eval-sequences",
        metavar="N",
        type=positive_int,
        help="windows evaluated, consecutive from the start of --eval-data "
        "(default: the global batch)",
    )
