"""PNG plots from run records: the reward/accuracy curve of a training run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_training_curve(rows: list[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Reward mean per step, with held-out accuracy on the steps where evaluation ran."""
    path = Path(path)
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rows if "reward_mean" in r]
    ax.plot(steps, [r["reward_mean"] for r in rows if "reward_mean" in r], label="reward mean")
    evals = [(r["step"], r["eval_accuracy"]) for r in rows if r.get("eval_accuracy") is not None]
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="held-out accuracy (greedy)")
    ax.set_xlabel("training step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title or "training curve")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
