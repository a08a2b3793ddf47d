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

from dorarl.engine import EngineConfig
from dorarl.runtime.actors import EngineSpec, TrainerSpec, spawn_engine, spawn_trainer
from dorarl.runtime.local_ray import start_local_ray
from dorarl.runtime.transfer.transports import make_transport
from dorarl.runtime.transfer.weights_config import TransportSpec
from dorarl.tasks.assets import BASE_MODEL_DIR
from dorarl.trainer import Trainer, TrainerConfig

_spec = importlib.util.spec_from_file_location(
    "trainer_conftest", Path(__file__).resolve().parents[2] / "trainer" / "conftest.py"
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
    saved = ray.get(group.save_checkpoint.remote(str(tmp_path / "version_00002"), {}, 1))
    written = saved.path  # a SavedCheckpoint: where, its size, its seconds
    assert (Path(written) / "shards").is_dir() and (Path(written) / "model.safetensors").is_file()

    (victim,) = ray.get(group.rank_pids.remote())
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(ray.exceptions.RayTaskError, match="trainer rank 1 of 2 died"):
        ray.get(group.train_step.remote(_make_groups(seed=30)))


def test_a_group_trainers_version_goes_from_engine_to_engine(local_ray):
    """A two-rank trainer's version of the shipped base (tied embeddings, as SmolLM2 and
    Qwen2.5's small models have) loads on an engine from rank 0 over the group, then on a
    second engine from the first: the peer serves every tensor the manifest names. A publish
    that carried lm_head, which a tied engine does not host, left the second load waiting
    out the group's timeout."""
    folder = str(BASE_MODEL_DIR)
    trainer = spawn_trainer(TrainerSpec(folder, TrainerConfig(lr=1e-3, world_size=2), 2))
    engine = EngineSpec(folder, EngineConfig(max_num_seqs=4, max_model_len=64))
    first, second = (spawn_engine(i, engine) for i in range(2))
    spec = TransportSpec("collective", "float32", 1 << 20, timeout_s=600.0, backend="gloo")
    transport = make_transport(spec, window=1)
    transport.start(trainer, [first, second])
    metrics, published = transport.step(trainer, _make_groups(seed=50))
    version = int(ray.get(metrics, timeout=120)["version"])
    transport.publish(version, published)
    assert ray.get(transport.load(first, version, None), timeout=120).version == version
    # a load that can never complete waits out the group's timeout (600 s), never this one
    assert ray.get(transport.load(second, version, first), timeout=120).version == version
    names = set(ray.get(second.weights.remote()))
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


@pytest.mark.usefixtures("shared_ray")
def test_dorarl_train_with_two_trainer_ranks(tmp_path):
    """On the collective transport, with the shipped base (tied embeddings), for 8 steps;
    whether a version also goes engine to engine depends on timing (the test above makes
    it happen)."""
    out, summary, trajectories, metrics, trace = _run(
        tmp_path,
        BASE_MODEL_DIR,
        "instances=2",  # loads from the trainer group or from the other engine
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
    assert loads and all(" from " in name for name in loads)
    newest = out / "checkpoints" / "version_00008"
    assert (newest / "shards").is_dir() and (newest / "model.safetensors").is_file()
