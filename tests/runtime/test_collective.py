"""Both weight transports on real actors (a trainer, two engines): every load, from the
trainer or a peer, gives the engine the trainer's bits in the engines' dtype; a load that
does not match the sender's fingerprints is refused in one line; a dead member's loads go
through the object store while the rest of the group keeps working."""

import importlib.util
from pathlib import Path

import pytest
import ray
import torch

from dorarl.engine import EngineConfig
from dorarl.runtime.actors import EngineSpec, TrainerSpec, spawn_engine, spawn_trainer
from dorarl.runtime.local_ray import start_local_ray
from dorarl.runtime.transports import make_transport
from dorarl.runtime.weights_config import TransportSpec
from dorarl.trainer import TrainerConfig

_spec = importlib.util.spec_from_file_location(
    "trainer_conftest", Path(__file__).resolve().parents[1] / "trainer" / "conftest.py"
)
_trainer_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_trainer_conftest)

pytestmark = pytest.mark.slow
DTYPE = "bfloat16"  # the engines': the trainer's float32 weights are cast once, at publish


@pytest.fixture(scope="module")
def actors(tiny_model_dir):
    """One Ray, a trainer and two engines, and both transports (the group formed once)."""
    start_local_ray(num_cpus=2)
    folder = str(tiny_model_dir)
    engine = EngineSpec(folder, EngineConfig(max_num_seqs=4, max_model_len=64, dtype=DTYPE))
    trainer = spawn_trainer(TrainerSpec(folder, TrainerConfig(lr=1e-2)))
    engines = [spawn_engine(i, engine) for i in range(2)]
    spec = dict(dtype=DTYPE, bucket_bytes=16 << 10, timeout_s=60.0, backend="gloo")
    transports = {
        kind: make_transport(TransportSpec(kind, **spec), window=1)
        for kind in ("object_store", "collective")
    }
    for transport in transports.values():
        transport.start(trainer, engines)
    yield trainer, engines, transports
    ray.shutdown()


def _step(trainer, transport, seed: int) -> int:
    """A training step published through `transport`; returns the new version."""
    metrics, handle = transport.step(trainer, _trainer_conftest._make_groups(seed=seed))
    version = int(ray.get(metrics)["version"])
    transport.publish(version, handle)
    return version


def _bits(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.to(getattr(torch, DTYPE)).contiguous().view(torch.int16) for n, t in named.items()}


def _assert_same_bits(engine, want: dict[str, torch.Tensor]) -> None:
    got = _bits(ray.get(engine.weights.remote()))
    assert got.keys() <= want.keys()
    assert all(torch.equal(got[n], want[n]) for n in got), [
        n for n in got if not torch.equal(got[n], want[n])
    ]


@pytest.mark.parametrize("kind", ["collective", "object_store"])
def test_both_transports_deliver_the_trainers_bits_from_it_and_from_a_peer(actors, kind):
    trainer, (first, second), transports = actors
    transport = transports[kind]
    version = _step(trainer, transport, seed=40 if kind == "collective" else 41)
    want = _bits(ray.get(trainer.weights.remote()))
    report = ray.get(transport.load(first, version, None))  # from the trainer
    assert report.version == version
    _assert_same_bits(first, want)
    ray.get(transport.load(second, version, first))  # peer to peer
    _assert_same_bits(second, want)


def test_a_load_unlike_the_senders_fingerprints_is_refused_in_one_line(actors):
    trainer, (first, _), transports = actors
    transport = transports["object_store"]
    version = _step(trainer, transport, seed=42)
    tampered = {n: t.clone() for n, t in ray.get(transport.trainer_copy(version)).items()}
    name = next(iter(tampered))
    tampered[name].view(-1)[0] += 1
    manifest = transport.manifest_for(version, None)
    before = _bits(ray.get(first.weights.remote()))
    with pytest.raises(ray.exceptions.RayTaskError) as refused:
        ray.get(first.load_weights.remote(tampered, version, manifest))
    line = str(refused.value.cause)
    assert "\n" not in line and line.startswith(
        f"weights of version {version} refused on instance 0"
    )
    assert f"tensor {name!r} (bucket 0 of " in line
    _assert_same_bits(first, before)  # the old weights stay
