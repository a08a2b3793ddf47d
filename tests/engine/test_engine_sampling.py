"""Per-request sampling: seeded streams, top-k/top-p, exact logprobs, stop and forced length."""

import copy
import math

import pytest
import torch
from engine_testlib import greedy, make_engine, prompts, run_all, run_alone, seeded, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from dorarl.engine import Engine, EngineConfig, SamplingParams
from dorarl.engine.sampler import SampleRow, first_argmax, sample, uniform


def test_seeded_sampling_ignores_batch_neighbours_and_engine_layout():
    model = tiny_model("llama", seed=1)
    prompt = prompts([9], seed=41)[0]
    params = seeded(30, seed=1234, top_p=0.9)
    alone = run_alone(model, prompt, params)
    engine = make_engine(model, block_size=8, prefill_chunk_size=4, max_num_seqs=5)
    neighbours = [
        greedy(7),
        seeded(40, seed=1),
        seeded(12, seed=2, top_k=5),
        SamplingParams(temperature=0.3, seed=3),
    ]
    for i, (p, nparams) in enumerate(
        zip(prompts([3, 20, 6, 14], seed=42), neighbours, strict=True)
    ):
        engine.add_request(f"n{i}", p, nparams)
    engine.add_request("x", prompt, params)
    got = run_all(engine)["x"]
    assert got.output_ids == alone.output_ids
    torch.testing.assert_close(
        torch.tensor(got.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0
    )


def test_different_seeds_give_different_samples_and_same_seed_repeats():
    model = tiny_model("qwen2", seed=1)
    engine = make_engine(model)
    prompt = prompts([5], seed=43)[0]
    for i, seed in enumerate([1, 2, 1]):
        engine.add_request(f"r{i}", prompt, seeded(20, seed=seed))
    outs = run_all(engine)
    assert outs["r0"].output_ids == outs["r2"].output_ids
    assert outs["r0"].output_ids != outs["r1"].output_ids


def test_uniform_stream_is_in_range_and_uses_the_whole_seed():
    draws = [uniform(7, n) for n in range(20_000)]
    assert all(0.0 < u < 1.0 for u in draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.01
    assert uniform(1, 0) != uniform(1 + (1 << 32), 0)  # high seed bits matter
    assert len(set(draws)) == len(draws)


def _rows(params: SamplingParams, n: int) -> list[SampleRow]:
    return [SampleRow(params, seed=99, counter=c) for c in range(n)]


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (3, 1.0), (0, 0.6), (4, 0.7)])
def test_sampling_follows_the_filtered_distribution_logprobs_the_tempered_one(top_k, top_p):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    temperature = 0.8
    probs = torch.softmax(logits / temperature, dim=-1).double()
    keep = torch.ones(8, dtype=torch.bool)  # logits are sorted, so filtering keeps a prefix
    if top_k:
        keep[top_k:] = False
    kept = probs * keep
    before = kept.cumsum(0) - kept
    keep &= before < top_p * kept.sum()
    target = probs * keep / (probs * keep).sum()
    n = 6000
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    tokens, logprobs = sample(logits.repeat(n, 1), _rows(params, n))
    counts = torch.bincount(torch.tensor(tokens), minlength=8).double()
    assert counts[~keep].sum() == 0
    expected = target * n
    chi2 = (((counts - expected) ** 2) / expected.clamp(min=1e-9))[keep].sum().item()
    assert chi2 < 30, f"chi2={chi2:.1f} for {counts.tolist()} vs {expected.tolist()}"
    # Logprobs are under softmax(logits / T), what the trainer computes (ratio 1 on-policy).
    for tok, lp in zip(tokens[:50], logprobs[:50], strict=True):
        assert math.isclose(lp, math.log(probs[tok].item()), abs_tol=1e-5)


def test_greedy_logprob_is_under_the_unmodified_softmax():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9]])
    tokens, logprobs = sample(logits, _rows(greedy(1), 1))
    assert tokens == [1]
    assert math.isclose(logprobs[0], torch.log_softmax(logits, -1)[0, 1].item(), abs_tol=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 4),
    vocab=st.sampled_from([1, 7, 255, 256, 300, 513, 1024]),
    levels=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_first_argmax_is_argmax_ties_included(rows, vocab, levels, seed):
    # Few distinct values: many ties, which must resolve to the first index as argmax does.
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (rows, vocab), generator=gen).float()
    assert torch.equal(first_argmax(logits), logits.argmax(dim=-1))


def test_target_len_ignores_stop_ids_and_stops_exactly():
    model = tiny_model("qwen2", seed=1)
    prompt = prompts([4], seed=44)[0]
    free = run_alone(model, prompt, greedy(30))
    stop = free.output_ids[3]  # a token greedy decoding emits early
    stopped = run_alone(
        model, prompt, SamplingParams(temperature=0.0, max_new_tokens=30, stop_token_ids=[stop])
    )
    assert stopped.finish_reason == "stop"
    assert stopped.output_ids == free.output_ids[: free.output_ids.index(stop) + 1]
    forced = run_alone(
        model, prompt, SamplingParams(temperature=0.0, stop_token_ids=[stop], target_len=37)
    )
    assert forced.finish_reason == "length"
    assert len(forced.output_ids) == 37
    assert forced.output_ids[:30] == free.output_ids


def test_default_stop_ids_are_the_models_eos():
    model = tiny_model("qwen2", seed=1)
    prompt = prompts([4], seed=44)[0]
    eos = run_alone(model, prompt, greedy(30)).output_ids[2]
    config = copy.deepcopy(model.config)
    config.eos_token_id = [eos, 127]
    engine = Engine.from_hf_config(config, EngineConfig(max_model_len=64), model.state_dict())
    engine.add_request("x", prompt, SamplingParams(temperature=0.0, max_new_tokens=30))
    out = run_all(engine)["x"]
    assert out.finish_reason == "stop" and out.output_ids[-1] == eos
