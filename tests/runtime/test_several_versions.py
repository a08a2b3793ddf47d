"""A LoRA run whose one engine holds two adapter versions (engine.max_versions=3, dora K=1):
at each publish the engine takes the new version while the old one's stragglers finish
beside it, so requests of two versions decode in the same engine step; nothing migrates,
nothing is lost, and an older version's adapter leaves once its last request ends."""

import pytest
from test_ray_runtime import COMMON, _check_invariants, _read

from dorarl.config import load_config
from dorarl.jobs.config import TrainConfig
from dorarl.jobs.ray_run import run_ray
from dorarl.record.pacing import DeviceModel

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]

STEPS = 6
LORA = ["trainer.lora.rank=8", "trainer.lora.lr=1e-3", "engine.max_versions=3"]


def test_one_engine_runs_two_adapter_versions_in_one_step(tmp_path, tiny_model_dir):
    overrides = [f"model={tiny_model_dir}", *COMMON, "instances=1", "mode=dora", "K=1"]
    overrides += [*LORA, "engine.prefix_cache=off", f"steps={STEPS}"]
    config = load_config(TrainConfig, overrides=overrides)
    assert config.versions_per_instance == 2
    out = tmp_path / "run"
    # paced steps keep the long tail of a version running after the next one is published
    run_ray(config, None, out, pace=DeviceModel(decode_step_s=0.02, train_fixed_s=0.05))
    summary, trajectories, metrics, trace = _read(out)
    _check_invariants(summary, trajectories, k=1)
    assert summary["steps"] == STEPS and summary["migrations"] == 0
    assert summary["mixed_version_steps"] > 0
    assert sum(m["mixed_version_steps"] for m in metrics) == summary["mixed_version_steps"]
    stale = [t for t in trajectories if t["train_version"] - t["behavior_version"] == 1]
    assert stale, "no straggler of an older version was trained on"
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    loads = [e["name"] for e in events if e.get("name", "").startswith("load v")]
    assert loads and all(name.endswith("from trainer") for name in loads)  # one instance
