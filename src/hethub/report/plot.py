"""PNG plots of a run (matplotlib, without a display)."""

from __future__ import annotations

from pathlib import Path


def loss_plot(path: Path, steps: list[int], losses: list[float], title: str) -> None:
    """The training loss per step."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write files only
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5), dpi=120)
    axes.plot(steps, losses, marker="." if len(steps) < 60 else None)
    axes.set_xlabel("step")
    axes.set_ylabel("loss (mean token cross-entropy)")
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
