"""PNG plots from run records: the reward/accuracy curve of a training run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

from dorarl.record.evaluations import held_out_count

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


def plot_training_curve(curve: dict[str, Any], path: str | Path, title: str = "") -> Path:
    """Reward mean per step at the version it made, held-out accuracy at the version it is of
    (`curve`: dorarl.report.run_curve's, the x axis of `dorarl report compare` too)."""
    path = Path(path)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(curve["steps"], curve["reward_mean"], label="reward mean")
    if curve["eval"]:
        versions = [p["version"] for p in curve["eval"]]
        accuracy = [p["accuracy"] for p in curve["eval"]]
        n = held_out_count(curve["eval"])
        counted = "" if n is None else f", n={n}"
        ax.plot(versions, accuracy, "o-", label=f"held-out accuracy (greedy{counted})")
    ax.set_xlabel("training step (version)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(title or "training curve", pad=22)
    # above the plotting area, under the title: never over a line
    ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncols=2, frameon=False, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
