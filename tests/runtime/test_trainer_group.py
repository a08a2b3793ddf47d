"""trainer.world_size=2 on local Ray: the group behind one actor equals one process, a
dead rank stops the run naming it, and `dorarl train` keeps the run invariants."""

import importlib.util
import os
import signal
from pathlib import Path

import pytest
import ray
import torch
from test_ray_runtime import _check_invariants, _run

from dorarl.runtime.actors import TrainerSpec, spawn_trainer
from dorarl.runtime.local_ray import start_local_ray
from dorarl.tasks.assets import BASE_MODEL_DIR
from dorarl.trainer import Trainer, TrainerConfig

_spec = importlib.util.spec_from_file_location(
    "trainer_conftest", Path(__file__).resolve().parents[1] / "trainer" / "conftest.py"
)
_trainer_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_trainer_conftest)
_make_groups = _trainer_conftest._make_groups  # the trainer tests' random groups

pytestmark = pytest.mark.slow


@pytest.fixture
def local_ray():
    start_local_ray()
    yield
    ray.shutdown()


def test_a_group_of_two_ranks_behind_one_actor(local_ray, tiny_model_dir, tmp_path):
    config = TrainerConfig(lr=1e-3, micro_batch_tokens=24, world_size=2)
    group = spawn_trainer(TrainerSpec(str(tiny_model_dir), config, 2))
    single = Trainer.from_pretrained(tiny_model_dir, TrainerConfig(lr=1e-3, micro_batch_tokens=24))
    for step in range(2):
        groups = _make_groups(seed=20 + step)
        call = group.train_step_and_weights.options(num_returns=3)
        metrics, weights, manifest = ray.get(call.remote(groups))  # no serving: plain copies
        assert manifest is None
        want = single.train_step(groups)
        assert metrics["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert metrics["tokens"] == want["tokens"] and metrics["version"] == step + 1
    assert weights.keys() == single.named_tensors().keys()
    for name, tensor in single.named_tensors().items():
        assert float((weights[name] - tensor).norm() / tensor.norm()) < 1e-5, name
    assert ray.get(group.version.remote()) == 2
    written = ray.get(group.save_checkpoint.remote(str(tmp_path / "version_00002"), {}, 1))
    assert (Path(written) / "shards").is_dir() and (Path(written) / "model.safetensors").is_file()

    (victim,) = ray.get(group.rank_pids.remote())
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(ray.exceptions.RayTaskError, match="trainer rank 1 of 2 died"):
        ray.get(group.train_step.remote(_make_groups(seed=30)))


def test_dorarl_train_with_two_trainer_ranks(tmp_path):
    """On the collective transport, with the shipped base (tied embeddings, as SmolLM2 and
    Qwen2.5's small models have), long enough that versions go from engine to engine: a
    peer serves what the group's rank 0 published. A publish the peer cannot serve left
    its receiver waiting out weights.timeout_s, then failed the run."""
    out, summary, trajectories, metrics, trace = _run(
        tmp_path,
        BASE_MODEL_DIR,
        "mode=dora",
        "K=1",
        "steps=8",
        "trainer.world_size=2",
        "checkpoint_every=4",
        "weights.transport=collective",
        "weights.timeout_s=60",
    )
    _check_invariants(summary, trajectories, k=1)
    assert [m["version"] for m in metrics] == list(range(8))
    assert all(m["tokens"] > 0 and torch.isfinite(torch.tensor(m["loss"])) for m in metrics)
    loads = [e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("load v")]
    assert any("from instance" in name for name in loads), loads
    newest = out / "checkpoints" / "version_00008"
    assert (newest / "shards").is_dir() and (newest / "model.safetensors").is_file()
