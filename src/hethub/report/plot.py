"""PNG plots of a run (matplotlib, without a display)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def loss_plot(
    path: Path,
    steps: Sequence[int],
    losses: Sequence[float],
    title: str,
    *,
    eval_steps: Sequence[int] = (),
    eval_losses: Sequence[float] = (),
) -> None:
    """The training loss per step, and the validation loss at the steps that computed one."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write files only
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5), dpi=120)
    axes.plot(steps, losses, marker="." if len(steps) < 60 else None, label="training")
    if eval_steps:
        axes.plot(eval_steps, eval_losses, marker="o", label="validation")
        axes.legend()
    axes.set_xlabel("step")
    axes.set_ylabel("loss (mean token cross-entropy)")
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
