"""Simulated runs side by side: each (name, controller config) on the same workload and cost.

Every run gets the same seed and lengths, so runs differ only in their schedule; each
returns the per-mode figures of `dorarl.report.figures` plus its run summary.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from dorarl.controller import ControllerConfig
from dorarl.report.figures import mode_figures
from dorarl.sim.runtime import SimRuntime
from dorarl.simulate.config import SimulateConfig

log = logging.getLogger(__name__)


def run_named(
    cfg: SimulateConfig, runs: list[tuple[str, ControllerConfig]], out: Path | None
) -> dict[str, dict]:
    """Run each (name, controller) on the same workload; name -> figures + run summary."""
    results = {}
    for name, controller in runs:
        started = time.perf_counter()
        sim = SimRuntime(
            controller,
            cfg.cost,
            cfg.lengths,
            seed=cfg.seed,
            out_dir=None if out is None else out / name,
            trace=cfg.trace,
            trajectories=cfg.trajectories,
            rewards=cfg.rewards,
        )
        result = sim.run()
        figures = mode_figures(result.steps, cfg.warmup_steps, controller.instances)
        figures.pop("pace")
        figures["all_steps"].pop("pace")
        results[name] = figures | {
            "mode": controller.mode,
            "K": controller.effective_K,
            "steps": result.summary["steps"],
            "dropped_total": result.summary["dropped_total"],
            "offloads": result.summary["offloads"],
            "throughput_tokens_per_s": result.summary["throughput_tokens_per_s"],
            "simulator_wall_s": time.perf_counter() - started,
            "events": result.events,
        }
        log.info("%s: %d events in %.1fs", name, result.events, results[name]["simulator_wall_s"])
    return results


def mode_controller(cfg: SimulateConfig, mode: str) -> ControllerConfig:
    controller = dataclasses.replace(cfg.controller, mode=mode)
    if controller.lockstep:  # the mode fixes these; set them so nothing is "ignored"
        controller = dataclasses.replace(controller, K=controller.effective_K, rbs=controller.tbs)
    return controller


def run_modes(cfg: SimulateConfig, modes: list[str], out: Path | None) -> dict[str, dict]:
    return run_named(cfg, [(m, mode_controller(cfg, m)) for m in modes], out)
