"""A paper preset's run beside the paper's figures, said as a comparison for the terminal."""

from __future__ import annotations

from typing import Any

from rich.table import Table

SHARES = {
    "sync rollout-only share": "sync",
    "dora rollout-only share": "dora",
}
"""The bars that are a mode's share of each step spent on rollout alone, by mode."""


def comparison_rows(bars: list[dict], consistency: dict[str, Any]) -> list[tuple[str, ...]]:
    """(quantity, this simulation, the paper, how they compare) per figure the paper gives:
    the rows of `check_bars` and the trainer-side ratio of `reference_consistency`."""
    rows = []
    for bar in bars:
        value, target = bar["value"], bar["target"]
        if bar["name"] in SHARES:
            mode = SHARES[bar["name"]]
            words = (
                f"{mode} spends {value:.0%} of each step on rollout alone here; "
                f"the paper measured {target:.0%}"
            )
            rows.append((bar["name"], f"{value:.0%}", f"{target:.0%}", words))
        else:
            words = f"dora is {value:.2f}x faster per step here; the paper measured {target:.2f}x"
            rows.append(("dora over sync, step time", f"{value:.2f}x", f"{target:.2f}x", words))
    if consistency:
        rows.append(_trainer_side(consistency))
    return rows


def _trainer_side(consistency: dict[str, Any]) -> tuple[str, ...]:
    simulated = consistency["simulated_non_rollout_ratio"]
    paper = consistency["paper_non_rollout_ratio"]
    words = (
        f"a dora step keeps the trainer side busy {simulated:.2f}x as long as a sync step "
        f"here; the paper's figures imply {paper:.2f}x (with equal training they would give a "
        f"{consistency['paper_speedup_at_equal_training']:.2f}x speedup)"
    )
    return ("trainer-side time per step", f"{simulated:.2f}x", f"{paper:.2f}x", words)


def comparison_table(bars: list[dict], consistency: dict[str, Any], preset: str) -> Table:
    table = Table(title=f"{preset}: this simulation beside the paper")
    for name in ("quantity", "this simulation", "the paper"):
        table.add_column(name, justify="right" if name != "quantity" else "left")
    table.add_column("how they compare")
    for row in comparison_rows(bars, consistency):
        table.add_row(*row)
    return table
