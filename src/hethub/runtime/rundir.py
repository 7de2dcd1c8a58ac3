"""A run's directory: everything one training run writes, and what a resume reads back.

runs/<name>/
  run.json         the run's settings (seed, the recipe, data, steps, checkpoint period,
                   evaluation)
  cluster.yaml     the cluster it ran on, plan.yaml the plan (the current one after a resume
                   under another plan; the earlier ones kept as plan.before-step-N.yaml)
  prediction.json  the predictor's figures and timeline for the plan, made before the run
  metrics.jsonl    one JSON object per step
  trace.json       Chrome trace: the predicted and the measured timeline of a step (the last;
                   rewritten every --trace-every steps while the run goes on)
  loss.png         the loss curve
  checkpoints/     step-NNNNNN/ (torch.distributed.checkpoint), complete ones only
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from hethub.errors import HethubError
from hethub.files import write_atomic


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSettings:
    """What must stay the same across a resume for its losses to equal an uninterrupted run's."""

    seed: int
    lr: float
    data: str | None
    """--data as given (resolved to an absolute path), None for the built-in corpus."""
    steps: int
    """Optimizer steps the run trains to in total."""
    checkpoint_every: int
    timeout_s: float
    keep_checkpoints: int = 3
    """Complete checkpoints kept (the latest ones); a run.json older than the field keeps 3."""
    # The recipe. A run.json older than these fields trained with a constant rate, no weight
    # decay and no clipping: their defaults here, so that such a run resumes as it trained.
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay, on every parameter but norms and biases."""
    warmup_steps: int | None = 0
    """Steps of linear warm-up (None: runtime.lr_schedule.default_warmup_steps)."""
    lr_schedule: str = "constant"
    """runtime.lr_schedule.LrSchedule after the warm-up: cosine, linear or constant."""
    min_lr: float | None = None
    """The rate a decay reaches at the last step (None: runtime.lr_schedule.default_min_lr)."""
    clip_grad: float = 0.0
    """The gradients' global norm is clipped to this (0: not clipped)."""
    init_from: str | None = None
    """A HuggingFace folder whose weights the run starts from (resolved to an absolute path;
    None: the seeded initialisation)."""
    seq_len: int | None = None
    """The sequence length, in place of the model's (None: the model's)."""
    eval_data: str | None = None
    """Held-out data the run evaluates on (None: no evaluation)."""
    eval_every: int | None = None
    """Evaluate every this many steps and at the last (None: at every checkpoint)."""
    eval_sequences: int | None = None
    """Windows evaluated, consecutive from the start of eval_data (None: the global batch)."""
    trace_every: int = 0
    """Write trace.json every this many steps as well as at the end (0: only at the end). Not
    what the losses depend on: a resume keeps it unless given again."""


DEFAULT_SETTINGS = RunSettings(
    seed=0,
    lr=3e-3,
    data=None,
    steps=90,  # enough for the local model's loss to halve: the first run shows it learns
    checkpoint_every=20,
    timeout_s=120.0,
    keep_checkpoints=3,
    weight_decay=0.1,
    warmup_steps=None,  # 5% of the run's steps
    lr_schedule="cosine",
    min_lr=None,  # a tenth of lr
    clip_grad=1.0,
)
"""A new run's settings where no flag is given (Megatron-LM's and torchtitan's usual recipe:
warm-up, cosine decay, weight decay 0.1, gradients clipped at norm 1)."""


class RunDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @property
    def plan(self) -> Path:
        return self.path / "plan.yaml"

    @property
    def cluster(self) -> Path:
        return self.path / "cluster.yaml"

    @property
    def prediction(self) -> Path:
        return self.path / "prediction.json"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def trace(self) -> Path:
        return self.path / "trace.json"

    @property
    def loss_plot(self) -> Path:
        return self.path / "loss.png"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def write_settings(self, settings: RunSettings) -> None:
        write_atomic(self.path / "run.json", json.dumps(asdict(settings), indent=2) + "\n")

    def read_settings(self) -> RunSettings:
        path = self.path / "run.json"
        if not path.is_file():
            raise HethubError(
                f"--resume = {str(self.path)!r}: not a run directory (no run.json in it)"
            )
        try:
            return RunSettings(**json.loads(path.read_text()))
        except (ValueError, TypeError) as error:
            raise HethubError(f"{path}: not a run.json hethub wrote ({error})") from None

    def append_metrics(self, record: dict) -> None:
        with self.metrics.open("a") as out:
            out.write(json.dumps(record) + "\n")

    def read_metrics(self) -> list[dict]:
        if not self.metrics.is_file():
            return []
        return [json.loads(line) for line in self.metrics.read_text().splitlines() if line.strip()]

    def keep_metrics_until(self, step: int) -> None:
        """Drop the records of steps after ``step``: an interrupted run logged steps after its
        last checkpoint, which the resumed run trains again."""
        kept = [r for r in self.read_metrics() if r.get("step", 0) <= step]
        write_atomic(self.metrics, "".join(json.dumps(r) + "\n" for r in kept))

    def write_json(self, path: Path, data: object) -> None:
        write_atomic(path, json.dumps(data))

    def write_text(self, path: Path, text: str) -> None:
        write_atomic(path, text)


def new_run_dir(parent: Path, name: str) -> RunDir:
    """runs/<name>, or runs/<name>-2, -3, ... when that exists: a new run never overwrites an old
    one."""
    candidate, n = parent / name, 1
    while candidate.exists():
        n += 1
        candidate = parent / f"{name}-{n}"
    try:
        candidate.mkdir(parents=True)
    except OSError as error:
        raise HethubError(
            f"cannot create the run directory {candidate} ({error.strerror})"
        ) from None
    return RunDir(candidate)
