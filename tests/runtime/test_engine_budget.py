"""The engines' KV budgets before any actor starts: each engine's share of a GPU of known
memory, refused in one line naming the key that gives the share when it cannot hold the
model and one max_model_len sequence; the GPU's memory from nvidia-smi without a CUDA
context; a live cluster refuses such a plan before placing anything."""

from __future__ import annotations

import os
import stat

import pytest
import ray
from transformers import Qwen2Config

from dorarl.bench.shapes import SHAPES
from dorarl.config import ConfigError, load_config
from dorarl.engine.memory import GB
from dorarl.engine.model_spec import spec_from_hf
from dorarl.jobs.config import TrainConfig
from dorarl.jobs.engine_plan import model_spec
from dorarl.runtime.engine_budget import engine_budgets, local_gpu_memory
from dorarl.runtime.local_ray import start_local_ray
from dorarl.runtime.placement import PlacementPlan, place_actors, plan_placement

QWEN_7B = spec_from_hf(Qwen2Config(**SHAPES["qwen2.5-7b"]))


def _config(*overrides: str) -> TrainConfig:
    return load_config(TrainConfig, None, ["engine.device=cuda", "trainer.device=cuda", *overrides])


def placement(config: TrainConfig, node_gpus: float) -> PlacementPlan:
    """The run's plan on a node of `node_gpus` GPUs, as `dorarl train` makes it."""
    return plan_placement(config.instances, config.engine, config.trainer, config.ray, node_gpus)


def budgets(config: TrainConfig, spec, plan: PlacementPlan, gpu_bytes: int | None):
    """The engines' budgets in `plan`'s shares, as `dorarl train` makes them."""
    return engine_budgets(config.instances, config.engine, spec, plan.shares, gpu_bytes)


def test_each_engine_gets_its_placement_share_and_a_plan_that_cannot_fit_is_refused():
    config = _config("engine.max_model_len=32768", "ray.engine_gpus=0.3333")
    plan = placement(config, 1)
    big = budgets(config, QWEN_7B, plan, int(141 * GB))
    assert [(b.actor, b.share) for b in big] == [("engine0", 0.3333), ("engine1", 0.3333)]
    for budget in big:
        budget.check()
        assert 0 < budget.kv.blocks < config.engine.kv_blocks
    small = budgets(config, QWEN_7B, plan, int(24 * GB))
    with pytest.raises(ConfigError, match=r"^ray.engine_gpus: engine0's 0.3333 of 24.0 GB"):
        small[0].check()
    own = _config("engine.max_model_len=32768", "engine.gpu_memory_share=0.9")
    for budget in budgets(own, QWEN_7B, placement(own, 1), int(24 * GB)):
        assert budget.key == "engine.gpu_memory_share" and budget.share == 0.9
        budget.check()


def test_unknown_memory_checks_nothing_and_says_what_each_share_must_hold():
    config = _config("engine.max_model_len=32768")
    (first, _) = budgets(config, QWEN_7B, placement(config, 1), None)
    first.check()
    assert first.kv is None and 15 * GB < first.minimum_bytes < 20 * GB
    assert "must hold" in first.line() and "set ray.gpu_memory_gb" in first.line()
    on_cpu = load_config(TrainConfig, None, [])
    assert budgets(on_cpu, QWEN_7B, placement(config, 1), 1) == []


def test_the_gpus_memory_comes_from_nvidia_smi(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 143771\necho 81559\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert local_gpu_memory() == 81559 * 2**20  # the smallest GPU
    smi.write_text("#!/bin/sh\nexit 9\n")
    assert local_gpu_memory() is None


@pytest.mark.slow
def test_a_share_too_small_is_refused_before_anything_is_placed(tiny_model_dir):
    spec, _ = model_spec(str(tiny_model_dir))
    config = _config("ray.gpu_memory_gb=1")  # a third of 1 GB: less than the workspace
    start_local_ray(num_cpus=1, num_gpus=1)  # a logical GPU: Ray only accounts it
    try:
        with pytest.raises(ConfigError, match=r"^ray.engine_gpus: engine0's 0.3333 of 1.00 GB"):
            place_actors(config.instances, config.engine, config.trainer, config.ray, spec)
        assert ray.util.placement_group_table() == {}
    finally:
        ray.shutdown()
