"""dashboard.png: a grid of small panels of the signals a training run is watched by (reward
and held-out accuracy, loss, clipping, KL, engine/trainer log-prob gap, entropy, gradient
norm, rate, lengths, staleness, throughput), each at the version its step made."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

from dorarl.record.evaluations import held_out_count
from dorarl.report.run_curve import History, curve_of, read_history
from dorarl.run_layout import RunFolder

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import Formatter, MaxNLocator  # noqa: E402

COLUMNS = 4
MARKED_UP_TO = 30  # steps up to which each point gets a marker (a short run's few points)


@dataclass(frozen=True)
class Panel:
    """One small plot: metrics.jsonl keys and their legend labels (one series: no legend,
    the title names it)."""

    title: str
    series: tuple[tuple[str, str], ...]
    share: bool = False  # a fraction: y from 0 to 1


REWARD_PANEL = "reward and held-out accuracy"
PANELS = (
    Panel(REWARD_PANEL, (("reward_mean", "reward mean"),), share=True),
    Panel("loss", (("loss", "loss"),)),
    Panel("clipped share (tokens)", (("clip_frac_low", "low"), ("clip_frac_high", "high"))),
    Panel("KL (k3, per token)", (("kl_behavior", "to behavior"), ("kl_ref", "to reference"))),
    Panel(
        "engine vs trainer |log-prob gap| (per token)",
        (("rollout_logp_abs_diff_fresh", "fresh"), ("rollout_logp_abs_diff", "all")),
    ),
    Panel("entropy (per token)", (("entropy", "entropy"),)),
    Panel("gradient norm (before clipping)", (("grad_norm", "grad norm"),)),
    Panel("learning rate", (("lr", "lr"),)),
    Panel("response length (tokens)", (("response_len_mean", "mean"), ("response_len_max", "max"))),
    Panel("truncated share", (("truncated_fraction", "truncated"),), share=True),
    Panel("staleness (versions)", (("staleness_mean", "mean"), ("staleness_max", "max"))),
    Panel("tokens/s", (("tokens_per_s", "tokens/s"),)),
    Panel(
        "step time (s)",
        (("step_time_s", "step"), ("rollout_only_s", "rollout only"), ("train_time_s", "train")),
    ),
)


def write_dashboard(run_dir: Path, title: str = "") -> Path | None:
    """Draw the run folder's dashboard.png from the history it keeps (None: no step yet)."""
    history = read_history(run_dir)
    if not history.rows:
        return None
    return plot_dashboard(history, RunFolder(run_dir).dashboard, title)


def plot_dashboard(history: History, path: str | Path, title: str = "") -> Path:
    path = Path(path)
    fig = dashboard_figure(history, title)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def dashboard_figure(history: History, title: str = "") -> Figure:
    """Every panel of PANELS, in rows of COLUMNS; a panel whose metrics the run did not
    record says so."""
    rows = -(-len(PANELS) // COLUMNS)
    fig, grid = plt.subplots(
        rows, COLUMNS, figsize=(4.2 * COLUMNS, 3.1 * rows), layout="constrained", squeeze=False
    )
    axes = list(grid.flat)
    span = _version_span(history.rows)
    for ax, panel in zip(axes, PANELS, strict=False):
        _draw_panel(ax, panel, history)
        ax.set_xlim(span[0] - 0.3, span[1] + 0.3)  # one x range: panels line up by version
    for ax in axes[len(PANELS) :]:
        ax.set_visible(False)
    for ax in axes[-COLUMNS:]:
        ax.set_xlabel("version (training step)")
    fig.suptitle(title or "training run", fontsize=13)
    return fig


def _draw_panel(ax: Axes, panel: Panel, history: History) -> None:
    ax.set_title(panel.title, loc="left", fontsize=10, pad=18)
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_formatter(TickLabels())
    ax.tick_params(labelsize=8)
    drawn = sum(_draw_series(ax, key, label, history.rows) for key, label in panel.series)
    if panel.title == REWARD_PANEL:
        drawn += _draw_accuracy(ax, history)
    if not drawn:
        ax.text(0.5, 0.5, "not recorded in this run", ha="center", va="center",
                transform=ax.transAxes, color="gray")  # fmt: skip
        return
    if panel.share:
        ax.set_ylim(-0.03, 1.03)
    if len(ax.get_lines()) > 1 or len(panel.series) > 1:
        # above the plotting area, under the title: never over a line
        ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncols=3, fontsize=8,
                  frameon=False, borderaxespad=0.1, handlelength=1.5)  # fmt: skip


def _draw_series(ax: Axes, key: str, label: str, rows: list[dict[str, Any]]) -> int:
    points = [(_version(r), r[key]) for r in rows if _is_number(r.get(key))]
    if not points:
        return 0
    xs, ys = zip(*points, strict=True)
    marker = "o" if len(points) <= MARKED_UP_TO else None
    style = "--" if key.endswith("_max") else "-"  # a mean under its max stays visible
    ax.plot(xs, ys, style, marker=marker, markersize=3, linewidth=1.4, label=label)
    return 1


def _draw_accuracy(ax: Axes, history: History) -> int:
    evals = curve_of(history.rows, history.times, history.evals)["eval"]
    if not evals:
        return 0
    n = held_out_count(evals)
    counted = "" if n is None else f", n={n}"
    ax.plot([e["version"] for e in evals], [e["accuracy"] for e in evals], "s-",
            markersize=4, linewidth=1.4, label=f"held-out accuracy (greedy{counted})")  # fmt: skip
    return 1


def _version_span(rows: list[dict[str, Any]]) -> tuple[int, int]:
    """From the version the history starts at (its evaluation is drawn there) to the last
    one made."""
    return int(rows[0].get("version", _version(rows[0]) - 1)), _version(rows[-1])


class TickLabels(Formatter):
    """Labels with the digits the ticks need and no offset text (which would sit by the
    panel's title): plain for ordinary magnitudes, else e-notation (a learning rate)."""

    def __init__(self) -> None:
        self.style = "g"
        self.digits = 4
        self.largest = 0.0

    def set_locs(self, locs: Any) -> None:
        super().set_locs(locs)
        values = [float(v) for v in locs]
        self.largest = max((abs(v) for v in values), default=0.0)
        self.style = "f" if 1e-3 <= self.largest < 1e5 else "e"
        self.digits = next(
            (d for d in range(12) if all(_exact(v, f"{v:.{d}{self.style}}") for v in values)), 12
        )

    def __call__(self, value: float, pos: int | None = None) -> str:
        if abs(value) <= 1e-9 * self.largest:  # zero, up to the locator's rounding
            return "0"
        return f"{value:.{self.digits}{self.style}}"


def _exact(value: float, label: str) -> bool:
    return math.isclose(float(label), value, rel_tol=1e-6, abs_tol=1e-12)


def _version(row: dict[str, Any]) -> int:
    """The version a step made: its reward and losses are plotted there."""
    return int(row.get("new_version", row.get("step", 0) + 1))


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
