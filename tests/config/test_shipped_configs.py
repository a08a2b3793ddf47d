"""Every file in configs/ loads, says what its comment says, and the simulation one runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from dorarl.config import load_config
from dorarl.jobs.config import TrainConfig
from dorarl.runtime.placement import PlacementPlan, plan_placement
from dorarl.simulate.cli import build_config
from dorarl.simulate.config import SimulateConfig
from dorarl.simulate.presets import PRESETS
from dorarl.simulate.runs import run_modes

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TRAIN = sorted(p for p in CONFIGS.glob("*.yaml") if not p.name.startswith("simulate-"))
SIMULATE = sorted(CONFIGS.glob("simulate-*.yaml"))


def test_the_folder_holds_the_setups_users_start_from():
    names = {p.name for p in CONFIGS.glob("*.yaml")}
    assert {
        "cpu.yaml",
        "gpu-1.yaml",
        "node-8gpu-qwen2.5-7b.yaml",
        "simulate-paper-64.yaml",
    } <= names


@pytest.mark.parametrize("path", TRAIN, ids=lambda p: p.name)
def test_train_configs_load(path):
    load_config(TrainConfig, path)


def test_the_cpu_config_is_the_default_run():
    assert load_config(TrainConfig, CONFIGS / "cpu.yaml") == load_config(TrainConfig)


def _plan(name: str, node_gpus: float) -> PlacementPlan:
    run = load_config(TrainConfig, CONFIGS / name)
    return plan_placement(run.instances, run.engine, run.trainer, run.ray, node_gpus)


def test_the_gpu_configs_fit_their_machines():
    one = _plan("gpu-1.yaml", 1)
    assert one.total_gpus <= 1 and set(one.shares) == {"engine0", "engine1", "trainer", "evaluator"}
    node = _plan("node-8gpu-qwen2.5-7b.yaml", 8)
    assert [b.gpus for b in node.bundles] == [1.0] * 8


def test_the_paper_64_file_is_the_preset():
    assert load_config(SimulateConfig, CONFIGS / "simulate-paper-64.yaml") == PRESETS["paper-64"]()


@pytest.mark.parametrize("path", SIMULATE, ids=lambda p: p.name)
def test_simulate_configs_run(path, tmp_path):
    cfg = build_config(None, str(path), ["controller.steps=2", "trace=false"])
    results = run_modes(cfg, ["dora"], tmp_path)
    assert {r["steps"] for r in results.values()} == {2}
