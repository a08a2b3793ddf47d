"""The vLLM backend on SmolLM2-135M-Instruct: greedy outputs equal HF generate's and the
behaviour log-probs are HF's on the same tokens (float32 on the CPU)."""

from __future__ import annotations

import time

import pytest
from vllm_testlib import hf_greedy_batch, hf_logprobs_batch, hf_model, run_all, start_engine

from dorarl.engine.config import SamplingParams

QUESTIONS = [
    "What is 7 + 5?", "Name a primary color.", "What is the capital of France?",
    "Write a haiku about rain.", "How many legs does a spider have?", "What is 12 * 3?",
    "Say hello in Spanish.", "What is the boiling point of water?", "Who wrote Hamlet?",
    "List three fruits.", "What is 100 - 37?", "Describe the sky in one sentence.",
    "What day comes after Monday?", "Spell the word cat backwards.", "What is a noun?",
    "Give me a synonym for happy.", "What is 9 squared?", "Name a planet.",
    "What color is grass?", "Translate 'thank you' into French.", "What is 15 / 3?",
    "Name an animal that can fly.", "What is the opposite of hot?", "Count to five.",
    "What is H2O?", "Why do we sleep?", "What is 2 to the power 5?", "Name a month.",
    "What shape has three sides?", "Who painted the Mona Lisa?", "What is a verb?",
    "How many days are in a week?",
]  # fmt: skip
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=32)


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    started = time.perf_counter()
    eng = start_engine(smollm2_dir, max_model_len=512)
    print(f"\nSmolLM2 vLLM engine started in {time.perf_counter() - started:.1f} s")
    yield eng
    eng.close()


def test_greedy_equals_hf_generate_and_logprobs_match(engine, smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                tokenize=True, return_dict=False)
        for q in QUESTIONS
    ]  # fmt: skip
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", list(p), GREEDY)
    started = time.perf_counter()
    done = run_all(engine)
    steps = engine.stats().steps
    print(
        f"32 requests: {steps} steps, {(time.perf_counter() - started) / steps * 1e3:.0f} ms/step"
    )
    hf = hf_model(smollm2_dir)
    prompts = [list(p) for p in prompts]
    outs = [done[f"q{i}"] for i in range(len(prompts))]
    greedy = hf_greedy_batch(hf, prompts, GREEDY.max_new_tokens, tok.eos_token_id)
    same = sum(out.output_ids == want for out, want in zip(outs, greedy, strict=True))
    worst = _worst_gap(outs, hf_logprobs_batch(hf, prompts, [o.output_ids for o in outs], 0.0))
    print(f"SmolLM2: {same}/32 greedy equal to HF generate, max |logprob diff| {worst:.2e}")
    assert same >= 30
    assert worst < 1e-3
    sampled = SamplingParams(temperature=0.7, top_k=50, max_new_tokens=32, seed=3)
    for i, p in enumerate(prompts[:4]):
        engine.add_request(f"t{i}", list(p), sampled)
    done = run_all(engine)
    outs = [done[f"t{i}"] for i in range(4)]
    refs = hf_logprobs_batch(hf, prompts[:4], [o.output_ids for o in outs], 0.7, top_k=50)
    worst = _worst_gap(outs, refs)
    print(f"SmolLM2 at temperature 0.7, top-k 50: max |logprob diff| {worst:.2e}")
    assert worst < 1e-3


def _worst_gap(outs: list, refs: list[list[float]]) -> float:
    """The largest |engine log-prob - HF's| over every output token."""
    return max(
        abs(a - b)
        for out, ref in zip(outs, refs, strict=True)
        for a, b in zip(out.logprobs, ref, strict=True)
    )
