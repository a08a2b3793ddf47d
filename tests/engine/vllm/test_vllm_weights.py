"""Weights into a running vLLM engine: a version whose tensors match the sender's
manifest is loaded (outputs then follow the new weights), one with a flipped tensor is
refused by the fingerprint check in vLLM's worker and leaves the old version serving."""

from __future__ import annotations

import functools

import pytest
import torch
from vllm_testlib import BASE_MODEL, hf_greedy, hf_model, run_all, start_engine

from dorarl.engine.config import SamplingParams
from dorarl.errors import UserInputError
from dorarl.runtime.transfer.weight_layout import WeightsRefused, build_manifest, wire_tensors

EOS = 2
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)
PROMPTS = [[1, 5, 9, 14, 30], [1, 40, 41, 42, 43, 44], [1, 70, 3, 3, 60, 61, 62, 8]]


@pytest.fixture(scope="module")
def engine():
    eng = start_engine(BASE_MODEL)
    yield eng
    eng.close()


def greedy_outputs(engine) -> list[list[int]]:
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"p{i}", p, GREEDY)
    done = run_all(engine)
    return [done[f"p{i}"].output_ids for i in range(len(PROMPTS))]


def new_version(seed: int = 0):
    """The base model's weights moved by seeded noise, as HF model and wire tensors."""
    model = hf_model(BASE_MODEL)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.add_(torch.randn(tensor.shape, generator=gen) * 0.05)
    return model, wire_tensors(model.state_dict(), torch.float32)


def check_of(named: dict[str, torch.Tensor], version: int):
    manifest = build_manifest(named, version, bucket_bytes=1 << 20)
    return functools.partial(manifest.verify, version=version, where="a test instance")


def prefix_hits_of_one_run(engine, prompt: list[int]) -> int:
    before = engine.view.prefix_hits
    engine.add_request("long", prompt, SamplingParams(temperature=0.0, max_new_tokens=1))
    run_all(engine)
    return engine.view.prefix_hits - before


def test_load_is_fingerprinted_in_the_worker(engine):
    long = [1] + list(range(10, 80))  # two full blocks of 32
    prefix_hits_of_one_run(engine, long)
    assert prefix_hits_of_one_run(engine, long) >= 64
    before = greedy_outputs(engine)
    model, named = new_version()
    check = check_of(named, 1)
    engine.add_request("busy", PROMPTS[0], GREEDY)
    with pytest.raises(UserInputError, match="in flight"):
        engine.load_weights(named, 1, check)
    engine.abort("busy")
    engine.load_weights(named, 1, check)
    assert engine.version == 1 and engine.cache_salt.endswith("/v1")
    assert prefix_hits_of_one_run(engine, long) == 0  # no block of version 0 is read
    after = greedy_outputs(engine)
    assert after != before
    assert after == [hf_greedy(model, p, GREEDY.max_new_tokens, EOS) for p in PROMPTS]

    _, named2 = new_version()
    flipped = dict(named2)
    name = "model.layers.1.mlp.down_proj.weight"
    flipped[name] = named2[name].clone()
    flipped[name][3, 7] = -flipped[name][3, 7]
    with pytest.raises(WeightsRefused, match=f"{name}.*fingerprint"):
        engine.load_weights(flipped, 2, check_of(named2, 2))
    assert engine.version == 1
    assert greedy_outputs(engine) == after  # the refused load left version 1 in place


def test_a_version_reaches_workers_apart_through_a_shared_file(engine):
    """The carrier of tensor-parallel workers (in other processes), taken here in-process."""
    assert not engine.weights_by_file  # one CPU worker in this process: by reference
    model, named = new_version(seed=3)
    engine.weights_by_file = True
    try:
        engine.load_weights(named, 3, check_of(named, 3))
    finally:
        engine.weights_by_file = False
    assert engine.version == 3
    assert greedy_outputs(engine) == [
        hf_greedy(model, p, GREEDY.max_new_tokens, EOS) for p in PROMPTS
    ]
