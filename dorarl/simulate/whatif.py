"""What-if: dora's speedup over sync and over partial rollout as the tail and K vary.

For every p99/median ratio the workload keeps the base preset's median, group correlation
and cap; sync runs once per ratio, partial_rollout and dora once per (ratio, K). Speedup is
end to end: mean step time of the other mode over dora's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from rich.table import Table

from dorarl.report.heatmap import plot_heatmaps
from dorarl.simulate.runs import run_named
from dorarl.simulate.validate import run_controller

RATIOS = (2.0, 5.0, 10.0, 20.0)
KS = (1, 2, 3)


def run_whatif(cfg: Any, ratios=RATIOS, ks=KS) -> dict[str, Any]:
    """Grid of speedups; `cfg` is a `SimulateConfig` (its controller's mode and k are set here)."""
    quiet = dataclasses.replace(cfg, trace=False, trajectories=False)
    cells = []
    for ratio in ratios:
        case = dataclasses.replace(quiet, lengths=dataclasses.replace(cfg.lengths, p99_ratio=ratio))
        runs = [("sync", run_controller(cfg.controller, "sync", 0))]
        for k in ks:
            rbs = max(cfg.controller.rbs, cfg.controller.tbs)
            for mode in ("partial_rollout", "dora"):
                controller = dataclasses.replace(cfg.controller, mode=mode, K=k, rbs=rbs)
                runs.append((f"{mode}_k{k}", controller))
        results = run_named(case, runs, None)
        cells += [_cell(ratio, k, results) for k in ks]
    return {"ratios": list(ratios), "ks": list(ks), "cells": cells}


def _cell(ratio: float, k: int, results: dict[str, dict]) -> dict[str, Any]:
    def step(name: str) -> float:
        return results[name]["step_time_s"]["mean"]

    dora = f"dora_k{k}"
    return {
        "p99_ratio": ratio,
        "k": k,
        "sync_step_s": step("sync"),
        "partial_step_s": step(f"partial_rollout_k{k}"),
        "dora_step_s": step(dora),
        "dora_over_sync": step("sync") / step(dora),
        "dora_over_partial": step(f"partial_rollout_k{k}") / step(dora),
        "dropped": sum(r["dropped_total"] for r in results.values()),
    }


def speedup_matrix(grid: dict[str, Any], key: str) -> list[list[float]]:
    at = {(c["p99_ratio"], c["k"]): c[key] for c in grid["cells"]}
    return [[at[(r, k)] for r in grid["ratios"]] for k in grid["ks"]]


def whatif_table(grid: dict[str, Any]) -> Table:
    table = Table(title="dora speedup (end-to-end step time): over sync / over partial rollout")
    table.add_column("K \\ p99/median", justify="right")
    for r in grid["ratios"]:
        table.add_column(f"{r:g}", justify="right")
    sync, partial = (
        speedup_matrix(grid, "dora_over_sync"),
        speedup_matrix(grid, "dora_over_partial"),
    )
    for k, row_s, row_p in zip(grid["ks"], sync, partial, strict=True):
        table.add_row(str(k), *(f"{s:.2f}x / {p:.2f}x" for s, p in zip(row_s, row_p, strict=True)))
    return table


def plot_whatif(grid: dict[str, Any], out: Path) -> Path:
    """Two heat maps side by side: dora over sync, dora over partial rollout."""
    panels = [
        (f"{title} (step-time speedup)", speedup_matrix(grid, key))
        for key, title in (
            ("dora_over_sync", "dora / sync"),
            ("dora_over_partial", "dora / partial rollout"),
        )
    ]
    columns = [f"{r:g}" for r in grid["ratios"]]
    return plot_heatmaps(
        panels, columns, [str(k) for k in grid["ks"]], "p99 / median response length", "K", out
    )
