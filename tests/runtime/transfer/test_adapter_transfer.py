"""LoRA versions as adapters on real actors (a LoRA trainer, two engines holding adapters), over
both transports: from the trainer and peer to peer an engine gets the trainer's adapter bit
for bit and samples what the merged weights sample; an adapter that arrives unlike its
sender's fingerprints is refused in one line, the resident adapters unchanged."""

import importlib.util
from pathlib import Path

import pytest
import ray
import torch

from dorarl.engine import EngineConfig, SamplingParams
from dorarl.errors import WorkerFailed
from dorarl.runtime.actors import EngineSpec, TrainerSpec, spawn_engine, spawn_trainer
from dorarl.runtime.local_ray import start_local_ray
from dorarl.runtime.ray_runtime import _describe
from dorarl.runtime.transfer.transports import make_transport
from dorarl.runtime.transfer.weight_layout import AdapterSpec, build_manifest
from dorarl.runtime.transfer.weights_config import TransportSpec
from dorarl.runtime.workers.engine_worker import EngineWorker, NewRequest
from dorarl.trainer import TrainerConfig
from dorarl.trainer.config import LoraConfig

_spec = importlib.util.spec_from_file_location(
    "trainer_conftest", Path(__file__).resolve().parents[2] / "trainer" / "conftest.py"
)
_trainer_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_trainer_conftest)

pytestmark = pytest.mark.slow
ENGINE = dict(max_num_seqs=4, max_model_len=64, prefix_cache="off", max_versions=3, max_lora_rank=8)
PROMPT = [1, 7, 12, 5, 9, 30, 4]


@pytest.fixture(scope="module")
def actors(tiny_model_dir):
    """One Ray, a LoRA trainer, two engines on the base, both transports carrying adapters."""
    start_local_ray(num_cpus=2)
    folder = str(tiny_model_dir)
    lora = LoraConfig(rank=4, alpha=8.0, lr=5e-2)
    trainer = spawn_trainer(TrainerSpec(folder, TrainerConfig(lr=1e-3, lora=lora)))
    engines = [spawn_engine(i, EngineSpec(folder, EngineConfig(**ENGINE))) for i in range(2)]
    spec = dict(dtype="float32", bucket_bytes=16 << 10, timeout_s=60.0, backend="gloo")
    transports = {
        kind: make_transport(TransportSpec(kind, **spec, adapters=True), window=1)
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


def _same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


def _request(version: int | None) -> list[NewRequest]:
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=11, stop_token_ids=[])
    return [NewRequest("r", PROMPT, params, version)]


def _sampled(engine, version: int) -> tuple[list[int], list[float]]:
    """The request's tokens and logprobs on engine actor `engine` under `version`."""
    ray.get(engine.add.remote(_request(version)))
    (out,) = ray.get(engine.run.remote(64)).finished
    return out.output_ids, out.logprobs


def _sampled_here(worker: EngineWorker) -> tuple[list[int], list[float]]:
    worker.add(_request(None))
    (out,) = worker.run(64).finished
    return out.output_ids, out.logprobs


@pytest.mark.parametrize("kind", ["collective", "object_store"])
def test_adapters_travel_bit_for_bit_and_sample_as_the_merged_weights(actors, kind, tiny_model_dir):
    trainer, (first, second), transports = actors
    transport = transports[kind]
    version = _step(trainer, transport, seed=50 if kind == "collective" else 51)
    adapter = ray.get(trainer.adapter_weights.remote())
    merged = ray.get(trainer.weights.remote())  # the same version, merged on the trainer
    manifest = ray.get(transport.manifest_for(version, None))
    assert manifest.adapter is not None and manifest.nbytes == sum(
        t.numel() * 4 for t in adapter.values()
    )
    assert ray.get(transport.load(first, version, None)).version == version  # the trainer's
    assert ray.get(transport.load(second, version, first)).version == version  # a peer's
    for engine in (first, second):
        assert ray.get(engine.resident_versions.remote()) == [0, version]
        assert _same_bits(ray.get(engine.weights.remote(version)), adapter)

    reference = EngineWorker(9, str(tiny_model_dir), EngineConfig(**{**ENGINE, "max_versions": 1}))
    reference.load_weights(merged, version)
    want_tokens, want_logprobs = _sampled_here(reference)
    for engine in (first, second):
        tokens, logprobs = _sampled(engine, version)
        assert tokens == want_tokens
        torch.testing.assert_close(
            torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-4, rtol=0
        )


def test_an_adapter_corrupted_on_its_way_over_the_group_is_refused(actors):
    """A peer whose copy of the version differs in one value (it loaded a flipped copy)
    sends it over the group: the receiver checks it against the trainer's fingerprints and
    refuses it in one line, its resident adapters as they were; the driver's line names it."""
    trainer, (first, second), transports = actors
    transport = transports["collective"]
    version = _step(trainer, transport, seed=52)
    ray.get(transport.load(second, version, None))
    kept = ray.get(second.resident_versions.remote())
    before = ray.get(second.weights.remote(version))
    true_manifest = ray.get(transport.manifest_for(version, None))

    tampered = {n: t.clone() for n, t in ray.get(trainer.adapter_weights.remote()).items()}
    name = next(n for n in tampered if ".lora_A." in n)
    tampered[name].view(-1)[3] = -tampered[name].view(-1)[3]
    # the peer accepts the flipped copy by a manifest made of it: then it serves those bits
    own = build_manifest(tampered, version, 16 << 10, AdapterSpec(8.0, 4))
    ray.get(first.load_weights.remote(tampered, version, own))
    ray.get(second.host_resident.remote(0))  # the receiver drops its copy: it must load again
    rank, via = transport.kv_route(first, second)
    call = second.receive_weights.remote(version, true_manifest, first, rank, via)
    with pytest.raises(ray.exceptions.RayTaskError) as refused:
        ray.get(call)
    line = str(refused.value.cause)
    assert "\n" not in line
    assert line.startswith(f"adapter of version {version} refused on instance 1: tensor {name!r}")
    assert ray.get(second.resident_versions.remote()) == [0]  # nothing half-loaded
    driver = WorkerFailed("engine instance 1 (weight load)", _describe(refused.value))
    assert "\n" not in str(driver) and "WeightsRefused: adapter of version" in str(driver)
    ray.get(transport.load(second, version, None))  # from the trainer: accepted
    assert _same_bits(ray.get(second.weights.remote(version)), before)
    assert ray.get(second.resident_versions.remote()) == kept


def test_a_flipped_adapter_through_the_object_store_is_refused(actors):
    trainer, (first, _), transports = actors
    transport = transports["object_store"]
    resident = ray.get(first.resident_versions.remote())
    version = _step(trainer, transport, seed=53)
    tampered = {n: t.clone() for n, t in ray.get(transport.trainer_copy(version)).items()}
    name = next(n for n in tampered if ".lora_B." in n)
    tampered[name].view(-1)[0] += 1
    manifest = transport.manifest_for(version, None)
    with pytest.raises(ray.exceptions.RayTaskError) as refused:
        ray.get(first.load_weights.remote(tampered, version, manifest))
    line = str(refused.value.cause)
    assert "\n" not in line and line.startswith(
        f"adapter of version {version} refused on instance 0: tensor {name!r} (bucket "
    )
    assert ray.get(first.resident_versions.remote()) == resident


def test_a_replacement_outside_the_group_gets_adapters_through_the_object_store(
    actors, tiny_model_dir
):
    """A replaced engine is outside the group: its loads of an adapter, from the trainer
    and from a peer, come as Ray objects, verified the same way."""
    trainer, (first, _), transports = actors
    transport = transports["collective"]
    version = _step(trainer, transport, seed=54)
    ray.get(transport.load(first, version, None))
    adapter = ray.get(trainer.adapter_weights.remote())
    outside = spawn_engine(2, EngineSpec(str(tiny_model_dir), EngineConfig(**ENGINE)))
    assert transport.kv_route(first, outside) is None  # not a member
    assert ray.get(transport.load(outside, version, None)).version == version
    assert _same_bits(ray.get(outside.weights.remote(version)), adapter)
    ray.get(outside.host_resident.remote(0))  # drops it: the peer's copy must travel again
    assert ray.get(transport.load(outside, version, first)).version == version
    assert _same_bits(ray.get(outside.weights.remote(version)), adapter)
    ray.kill(outside)
