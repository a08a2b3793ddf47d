"""The convergence PNG: held-out accuracy and reward, against training step and wall time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

from dorarl.record.evaluations import held_out_count

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_convergence(
    curves: dict[str, dict[str, Any]],
    out: str | Path,
    time_label: str = "wall time on emulated devices (s)",
) -> Path:
    """2 x 2: accuracy by step | accuracy by wall time; reward by step | reward by wall time."""
    fig, axes = plt.subplots(2, 2, figsize=(12, 7), sharey="row")
    for k, (name, c) in enumerate(curves.items()):
        color = plt.get_cmap("tab10")(k)
        versions = [p["version"] for p in c["eval"]]
        accuracy = [p["accuracy"] for p in c["eval"]]
        n = held_out_count(c["eval"])
        counted = name if n is None else f"{name} (n={n})"  # held-out prompts behind each point
        axes[0][0].plot(versions, accuracy, "o-", color=color, label=counted)
        axes[0][1].plot(
            [p["time_s"] for p in c["eval"]], accuracy, "o-", color=color, label=counted
        )
        axes[1][0].plot(c["steps"], c["reward_mean"], color=color, label=name)
        axes[1][1].plot(c["time_s"], c["reward_mean"], color=color, label=name)
    axes[0][0].set_ylabel("held-out accuracy (greedy)")
    axes[1][0].set_ylabel("reward mean of consumed groups")
    for ax in axes[1]:
        ax.set_xlabel("")
    axes[1][0].set_xlabel("training step (version)")
    axes[1][1].set_xlabel(time_label)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)
