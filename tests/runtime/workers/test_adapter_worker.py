"""An engine worker hosting LoRA versions as adapters over its base (engine.max_versions > 1),
in one process: an adapter version samples what the merged weights sample, its slot reads
back bit for bit, a corrupted adapter is refused by its fingerprint with the resident
adapters unchanged, and a load drops the adapters neither held by the runtime nor used by
a request."""

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM

from dorarl.engine import EngineConfig, SamplingParams
from dorarl.engine.config import ADAPTED_PROJECTIONS
from dorarl.engine.lora import _TARGETS, merge_adapter
from dorarl.runtime.transfer.weight_layout import (
    AdapterSpec,
    WeightsRefused,
    build_manifest,
    wire_tensors,
)
from dorarl.runtime.workers.engine_worker import EngineWorker, NewRequest

RANK, ALPHA = 4, 8.0
PROMPT = [1, 5, 6, 7, 9, 3]


def _config(**over) -> EngineConfig:
    base = dict(max_num_seqs=4, max_model_len=64, prefix_cache="off", max_versions=3,
                max_lora_rank=8)  # fmt: skip
    return EngineConfig(**{**base, **over})


def _adapter(folder, seed: int) -> dict[str, torch.Tensor]:
    """peft's adapter tensors on the folder's model, B drawn non-zero (a trained adapter)."""
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    torch.manual_seed(seed)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear")
    peft = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn_like(param) * 0.2)
    return {n: t.detach().clone() for n, t in get_peft_model_state_dict(peft).items()}


def _manifest(named: dict[str, torch.Tensor], version: int):
    wire = wire_tensors(named, torch.float32)
    return build_manifest(wire, version, bucket_bytes=1 << 14, adapter=AdapterSpec(ALPHA, RANK))


def _sample(worker: EngineWorker, rid: str, version: int | None) -> tuple[list[int], list[float]]:
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3, stop_token_ids=[])
    worker.add([NewRequest(rid, PROMPT, params, version)])
    outputs = []
    while not outputs:
        outputs = worker.run(max_steps=32).finished
    return outputs[0].output_ids, outputs[0].logprobs


@pytest.fixture(scope="module")
def adapters(tiny_model_dir):
    return {v: _adapter(tiny_model_dir, seed=v) for v in (1, 2, 3)}


def test_an_adapter_version_samples_what_its_merged_weights_sample(tiny_model_dir, adapters):
    worker = EngineWorker(0, str(tiny_model_dir), _config())
    named = adapters[1]
    report = worker.load_weights(named, 1, _manifest(named, 1))
    assert report.version == 1 and worker.resident_versions() == [0, 1]
    served = worker.weights(1)  # what a peer gets: the slot read back, bit for bit
    assert served.keys() == named.keys()
    assert all(torch.equal(served[n], named[n]) for n in named)
    tokens, logprobs = _sample(worker, "adapter", 1)

    merged = EngineWorker(1, str(tiny_model_dir), _config(max_versions=1))
    full = merge_adapter(merged.weights(), named, ALPHA, RANK)
    merged.load_weights(full, 1)
    want_tokens, want_logprobs = _sample(merged, "merged", None)
    assert tokens == want_tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-4,
                               rtol=0)  # fmt: skip
    base_tokens, _ = _sample(worker, "base", 0)
    assert base_tokens != tokens  # the adapter really changes the policy


def test_a_corrupted_adapter_is_refused_and_the_resident_ones_stay(tiny_model_dir, adapters):
    worker = EngineWorker(0, str(tiny_model_dir), _config())
    worker.load_weights(adapters[1], 1, _manifest(adapters[1], 1))
    before = {n: t.clone() for n, t in worker.weights(1).items()}
    named = adapters[2]
    manifest = _manifest(named, 2)
    tampered = {n: t.clone() for n, t in named.items()}
    name = next(n for n in tampered if ".lora_B." in n)
    tampered[name].view(-1)[5] = -tampered[name].view(-1)[5]  # one flipped sign bit
    with pytest.raises(WeightsRefused) as refused:
        worker.load_weights(tampered, 2, manifest)
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith(f"adapter of version 2 refused on instance 0: tensor {name!r}")
    assert worker.resident_versions() == [0, 1]
    after = worker.weights(1)
    assert all(torch.equal(after[n], before[n]) for n in before)


def test_a_load_drops_the_adapters_no_request_uses(tiny_model_dir, adapters):
    worker = EngineWorker(0, str(tiny_model_dir), _config())
    worker.load_weights(adapters[1], 1, _manifest(adapters[1], 1))
    params = SamplingParams(max_new_tokens=40, stop_token_ids=[])
    worker.add([NewRequest("long", PROMPT, params, 1)])  # still runs under 1
    worker.run(max_steps=2, until_finished=False)
    worker.load_weights(adapters[2], 2, _manifest(adapters[2], 2))
    assert worker.resident_versions() == [0, 1, 2]  # 1 is kept: a request runs under it
    assert not worker.unload_version(1)
    worker.abort(["long"])
    worker.load_weights(adapters[3], 3, _manifest(adapters[3], 3))
    assert worker.resident_versions() == [0, 3]  # 1 and 2 unused: dropped
    assert worker.host_resident(0).version == 0  # the base: nothing moves
    assert worker.resident_versions() == [0]
    with pytest.raises(WeightsRefused, match="version 5 is not resident on instance 0"):
        worker.host_resident(5)


def test_a_held_version_stays_through_loads_until_it_is_unloaded(tiny_model_dir, adapters):
    """The runtime holds 1 for a request that is on no engine yet (its episode's reset is
    out): loads keep its adapter, and the request then runs under it."""
    worker = EngineWorker(0, str(tiny_model_dir), _config())
    worker.load_weights(adapters[1], 1, _manifest(adapters[1], 1))
    assert worker.hold_versions([1]) == [1]
    worker.load_weights(adapters[2], 2, _manifest(adapters[2], 2))
    assert worker.host_resident(2).version == 2
    assert worker.resident_versions() == [0, 1, 2]
    tokens, _ = _sample(worker, "late", 1)
    assert tokens
    assert worker.unload_version(1)
    assert worker.resident_versions() == [0, 2]


def test_the_engine_adapts_what_the_run_config_allows():
    assert {f"{proj}_proj" for _, proj in _TARGETS} == ADAPTED_PROJECTIONS
