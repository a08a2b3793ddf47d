"""`dorarl train runtime=sim`: the same controller on cost-model instances (no learning)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dorarl.jobs.config import TrainConfig
from dorarl.sim.runtime import SimRuntime


def run_sim(config: TrainConfig, out_dir: Path) -> dict[str, Any]:
    # a sim run never resumes (TrainConfig.validate refuses resume= with it)
    runtime = SimRuntime(config.controller_config(None), seed=config.seed, out_dir=out_dir)
    return runtime.run().summary
