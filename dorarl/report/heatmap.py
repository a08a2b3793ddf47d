"""Heat maps with their values written in the cells (the `dorarl simulate --whatif` grid)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_heatmaps(
    panels: list[tuple[str, list[list[float]]]],
    columns: list[str],
    rows: list[str],
    xlabel: str,
    ylabel: str,
    out: Path,
) -> Path:
    """One heat map per (title, values) side by side; values[i][j] is row i, column j."""
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.6), squeeze=False)
    for ax, (title, values) in zip(axes[0], panels, strict=True):
        image = ax.imshow(values, cmap="viridis", aspect="auto", origin="lower")
        middle = (min(map(min, values)) + max(map(max, values))) / 2
        for i, row in enumerate(values):
            for j, v in enumerate(row):
                color = "k" if v > middle else "w"  # legible on viridis' light end
                ax.text(j, i, f"{v:.2f}x", ha="center", va="center", color=color, fontsize=9)
        ax.set_xticks(range(len(columns)), columns)
        ax.set_yticks(range(len(rows)), rows)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
