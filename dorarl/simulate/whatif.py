"""What-if grids on the simulator: the tail (p99/median) x K, and the split of devices
between rollout and training.

tail: for every p99/median ratio the workload keeps the base preset's median, group
correlation and cap; sync runs once per ratio, partial_rollout and dora once per (ratio, K).
Speedup is end to end: mean step time of the other mode over dora's.

split: the preset's devices (its instances' and its trainer's) stay the same in total and
move between rollout instances (of the preset's size) and the trainer, whose time per token
the cost model scales with its devices (`CostModel.with_trainer_devices`); sync and dora at
each K run at every split. Speedup is sync's mean step time at the preset's own split over
the cell's: the faster split for a mode is the larger number in its column.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

from dorarl.report.heatmap import plot_heatmaps
from dorarl.sim.cost import CostModel
from dorarl.simulate.runs import run_named
from dorarl.simulate.validate import run_controller

RATIOS = (2.0, 5.0, 10.0, 20.0)
KS = (1, 2, 3)
SPLIT_SHARES = (0.25, 0.375, 0.5, 0.625, 0.75)
"""Shares of the devices that serve rollout in the split grid (the preset's own is added)."""
WHATIF_AXES = ("tail", "split")


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
    return {"axis": "tail", "ratios": list(ratios), "ks": list(ks), "cells": cells}


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


# ---- the split of devices between rollout and training ----------------------------------
@dataclass(frozen=True)
class Split:
    """`instances` rollout instances of `instance_devices` each; the trainer on the rest."""

    instances: int
    instance_devices: int
    trainer_devices: int

    @property
    def rollout_devices(self) -> int:
        return self.instances * self.instance_devices

    @property
    def label(self) -> str:
        return f"{self.rollout_devices} / {self.trainer_devices}"


def splits(cost: CostModel, instances: int, shares=SPLIT_SHARES) -> list[Split]:
    """Ways to split the devices of `instances` instances and the trainer of `cost` between
    the two, the trainer keeping one device at least; the given split among them."""
    per = cost.instance_devices
    total = instances * per + cost.trainer_devices
    most = (total - 1) // per
    counts = {min(most, max(1, round(share * total / per))) for share in shares} | {instances}
    return [Split(n, per, total - n * per) for n in sorted(counts)]


def _split_runs(cfg: Any, split: Split, ks) -> tuple[Any, list[tuple[str, Any]]]:
    """The config of one split, and its runs: sync, then dora at each K."""
    controller = dataclasses.replace(cfg.controller, instances=split.instances)
    case = dataclasses.replace(
        cfg, controller=controller, cost=cfg.cost.with_trainer_devices(split.trainer_devices)
    )
    rbs = max(controller.rbs, controller.tbs)
    runs = [("sync", run_controller(controller, "sync", 0))]
    runs += [
        (f"dora K={k}", dataclasses.replace(controller, mode="dora", K=k, rbs=rbs)) for k in ks
    ]
    return case, runs


def run_split_whatif(cfg: Any, shares=SPLIT_SHARES, ks=KS) -> dict[str, Any]:
    """Step time and throughput of sync and dora (each K) at every split of `cfg`'s devices
    (`cfg`: a `SimulateConfig`); speedups over sync at `cfg`'s own split."""
    quiet = dataclasses.replace(cfg, trace=False, trajectories=False)
    cells = []
    for split in splits(cfg.cost, cfg.controller.instances, shares):
        case, runs = _split_runs(quiet, split, ks)
        for run, figures in run_named(case, runs, None).items():
            cells.append(_split_cell(split, run, figures))
    base = next(
        c for c in cells if c["instances"] == cfg.controller.instances and c["run"] == "sync"
    )
    for cell in cells:
        cell["speedup"] = base["step_s"] / cell["step_s"]
    return {
        "axis": "split",
        "total_devices": cfg.controller.instances * cfg.cost.instance_devices
        + cfg.cost.trainer_devices,
        "instance_devices": cfg.cost.instance_devices,
        "base_instances": cfg.controller.instances,
        "runs": list(dict.fromkeys(c["run"] for c in cells)),
        "splits": list(dict.fromkeys(c["split"] for c in cells)),
        "cells": cells,
    }


def _split_cell(split: Split, run: str, figures: dict[str, Any]) -> dict[str, Any]:
    return {
        "split": split.label,
        "instances": split.instances,
        "rollout_devices": split.rollout_devices,
        "trainer_devices": split.trainer_devices,
        "run": run,
        "step_s": figures["step_time_s"]["mean"],
        "train_s": figures["train_time_s"],
        "tokens_per_s": figures["consumed_tokens_per_s"],
        "rollout_only_share": figures["rollout_only_share"],
        "dropped": figures["dropped_total"],
    }


def split_matrix(grid: dict[str, Any], key: str = "speedup") -> list[list[float]]:
    """values[i][j]: split i (fewest rollout devices first), run j (sync, dora K=..)."""
    at = {(c["split"], c["run"]): c[key] for c in grid["cells"]}
    return [[at[(s, r)] for r in grid["runs"]] for s in grid["splits"]]


def _base_label(grid: dict[str, Any]) -> str:
    return next(c["split"] for c in grid["cells"] if c["instances"] == grid["base_instances"])


def split_table(grid: dict[str, Any]) -> Table:
    """Rows: splits; columns: runs; cells: speedup (mean step s)."""
    table = Table(title=f"speedup over sync at {_base_label(grid)} (mean step s)")
    table.add_column("rollout / trainer devices", justify="right")
    for run in grid["runs"]:
        table.add_column(run, justify="right")
    speedup, step = split_matrix(grid), split_matrix(grid, "step_s")
    for label, row_x, row_s in zip(grid["splits"], speedup, step, strict=True):
        table.add_row(label, *(f"{x:.2f}x ({s:,.1f})" for x, s in zip(row_x, row_s, strict=True)))
    return table


def split_lines(grid: dict[str, Any]) -> list[str]:
    """What the split grid kept fixed, and each run's fastest split."""
    best = []
    for run in grid["runs"]:
        cell = min((c for c in grid["cells"] if c["run"] == run), key=lambda c: c["step_s"])
        best.append(f"{run} at {cell['split']} ({cell['speedup']:.2f}x)")
    return [
        f"{grid['total_devices']} devices in all, {grid['instance_devices']} per rollout "
        f"instance; the preset's split is {_base_label(grid)}",
        "fastest split (rollout / trainer devices): " + "; ".join(best),
    ]


def plot_split(grid: dict[str, Any], out: Path) -> Path:
    """One heat map: speedup per split (rows) and run (columns)."""
    panels = [(f"speedup over sync at {_base_label(grid)}", split_matrix(grid))]
    return plot_heatmaps(
        panels, grid["runs"], grid["splits"], "run", "rollout / trainer devices", out
    )
