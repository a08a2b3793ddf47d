"""Both weight transports on real actors (a trainer, two engines): every load, from the
trainer or a peer, gives the engine the trainer's bits in the engines' dtype; a load that
does not match the sender's fingerprints is refused in one line; a dead member's loads go
through the object store while the rest of the group keeps working; a migration's KV
goes over the group and the request continues exactly."""

import importlib.util
from pathlib import Path

import pytest
import ray
import torch

from dorarl.engine import EngineConfig, SamplingParams
from dorarl.runtime.actors import EngineSpec, TrainerSpec, spawn_engine, spawn_trainer
from dorarl.runtime.local_ray import start_local_ray
from dorarl.runtime.transfer.transports import make_transport
from dorarl.runtime.transfer.weights_config import TransportSpec
from dorarl.runtime.workers.engine_worker import NewRequest
from dorarl.trainer import TrainerConfig

_spec = importlib.util.spec_from_file_location(
    "trainer_conftest", Path(__file__).resolve().parents[2] / "trainer" / "conftest.py"
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


def test_a_migration_over_the_group_continues_as_if_the_request_never_moved(actors):
    """The KV goes point to point over the group (the snapshots' metadata through Ray): the
    migrated request samples the tokens of the same request run where it lands, unmoved."""
    trainer, (first, second), transports = actors
    transport = transports["collective"]
    version = _step(trainer, transport, seed=43)
    ray.get([transport.load(first, version, None), transport.load(second, version, None)])
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=20, stop_token_ids=[],
                            seed=5)  # fmt: skip
    prompt = [(3 * i + 1) % 60 for i in range(11)]
    ray.get(second.add.remote([NewRequest("unmoved", prompt, params)]))
    (want,) = ray.get(second.run.remote(64)).finished
    ray.get(first.add.remote([NewRequest("moved", prompt, params)]))
    ray.get(first.run.remote(6))
    route = transport.kv_route(first, second)
    assert route == (1, "group") and transports["object_store"].kv_route(first, second) is None
    ids, parcel = first.export_kv.options(num_returns=2).remote(["moved"])
    assert ray.get(second.import_parcel.remote(parcel, first, *route)) == ["moved"]
    assert ray.get(parcel).snapshots[0].kv is None  # no KV went through the object store
    assert ray.get(first.held_tickets.remote()) == 0  # delivered, let go
    (got,) = ray.get(second.run.remote(64)).finished
    assert got.output_ids == want.output_ids and got.migrations == 1


def test_a_source_that_dies_holding_the_kv_loses_nothing(actors):
    """The source died after its export, before sending: the destination's receive fails,
    and the request continues from its tokens there (re-prefill), none of them lost. Last
    here: it kills an engine of the module's group."""
    trainer, (first, second), transports = actors
    transport = transports["collective"]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=[], seed=6)
    ray.get(first.add.remote([NewRequest("orphan", [4, 5, 6, 7, 8], params)]))
    ray.get(first.run.remote(4))
    ids, parcel = first.export_kv.options(num_returns=2).remote(["orphan"])
    (kept,) = ray.get(parcel).snapshots
    ray.kill(first)
    assert ray.get(second.import_parcel.remote(parcel, first, *transport.kv_route(first, second)))
    (out,) = ray.get(second.run.remote(64)).finished
    assert out.output_ids[: len(kept.output_ids)] == kept.output_ids and len(out.output_ids) == 12
    assert out.reprefill_tokens == kept.num_tokens - 1
