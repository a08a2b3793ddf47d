"""LoRA versions as vLLM adapters (engine.max_versions > 1): an adapter version's greedy
tokens are those of HF's model with the adapter merged, requests of the base and of two
adapter versions run side by side, each under its own version, and a version in use is not
dropped."""

from __future__ import annotations

import pytest
import torch
from vllm_testlib import BASE_MODEL, hf_greedy, hf_model, run_all

from dorarl.engine.config import EngineConfig, SamplingParams
from dorarl.engine.vllm.config import VllmArgs
from dorarl.errors import UserInputError

EOS = 2
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)
PROMPTS = [[1, 5, 9, 14, 30], [1, 40, 41, 42, 43, 44]]
TARGETS = ("q_proj", "v_proj", "down_proj")
RANK, ALPHA = 8, 16.0


@pytest.fixture(scope="module")
def engine():
    from dorarl.engine.vllm.engine import VllmEngine

    config = EngineConfig(
        backend="vllm", max_model_len=128, max_num_seqs=8, max_versions=3, max_lora_rank=8
    )
    eng = VllmEngine.from_pretrained(
        BASE_MODEL, config, args=VllmArgs(enforce_eager=True, block_size=32)
    )
    yield eng
    eng.close()


def adapter(seed: int) -> dict[str, torch.Tensor]:
    """Random lora_A / lora_B (peft's names) on TARGETS of every layer, large enough to
    change greedy tokens."""
    model = hf_model(BASE_MODEL)
    gen = torch.Generator().manual_seed(seed)
    named = {}
    for name, module in model.named_modules():
        if name.endswith(TARGETS) and isinstance(module, torch.nn.Linear):
            out, inp = module.weight.shape
            prefix = f"base_model.model.{name}"
            named[f"{prefix}.lora_A.weight"] = torch.randn(RANK, inp, generator=gen) * 0.3
            named[f"{prefix}.lora_B.weight"] = torch.randn(out, RANK, generator=gen) * 0.3
    return named


def merged_greedy(named: dict[str, torch.Tensor]) -> list[list[int]]:
    """HF's greedy tokens with the adapter merged in: W + B @ A * alpha / rank."""
    model = hf_model(BASE_MODEL)
    weights = dict(model.named_parameters())
    with torch.no_grad():
        for name, a in named.items():
            if ".lora_A." not in name:
                continue
            b = named[name.replace(".lora_A.", ".lora_B.")]
            target = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            weights[target].add_(b @ a * (ALPHA / RANK))
    return [hf_greedy(model, p, GREEDY.max_new_tokens, EOS) for p in PROMPTS]


def test_adapter_versions_run_beside_the_base_each_under_its_own(engine):
    """A base request already decoding when the adapters load keeps the base's tokens too."""
    one, two = adapter(1), adapter(2)
    early = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[])
    engine.add_request("early", PROMPTS[1], early)
    engine.step()
    engine.load_adapter(1, one, ALPHA, RANK)
    engine.load_adapter(2, two, ALPHA, RANK)
    assert engine.resident_versions() == [0, 1, 2]
    for version in (0, 1, 2):
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"v{version}-{i}", p, GREEDY, version=version)
    engine.step()
    assert engine.last_step.versions == 3  # the three versions share the step
    done = run_all(engine)
    model = hf_model(BASE_MODEL)
    base = [hf_greedy(model, p, GREEDY.max_new_tokens, EOS) for p in PROMPTS]
    assert done["early"].output_ids == hf_greedy(model, PROMPTS[1], 12, eos=-1)
    for version, want in ((0, base), (1, merged_greedy(one)), (2, merged_greedy(two))):
        got = [done[f"v{version}-{i}"].output_ids for i in range(len(PROMPTS))]
        assert got == want, f"version {version}"
        assert all(set(done[f"v{version}-{i}"].versions) == {version} for i in range(2))
    assert merged_greedy(one) != base  # the adapter changes what is sampled


def test_a_version_in_use_stays_and_a_full_engine_takes_no_more(engine):
    with pytest.raises(UserInputError, match="max_versions=3"):
        engine.load_adapter(3, adapter(3), ALPHA, RANK)
    engine.add_request("busy", PROMPTS[0], GREEDY, version=1)
    with pytest.raises(UserInputError, match="still run under it"):
        engine.unload_version(1)
    engine.abort("busy")
    engine.unload_version(1)
    assert engine.resident_versions() == [0, 2]
    with pytest.raises(UserInputError, match="is not hosted here"):
        engine.add_request("gone", PROMPTS[0], GREEDY, version=1)
    tensors, alpha, rank = engine.adapter_tensors(2)
    assert (alpha, rank) == (ALPHA, RANK) and set(tensors) == set(adapter(2))
