"""Our forward pass, paged attention and logprobs against Hugging Face's own models.

Every family (Llama, Qwen2, Qwen3), tied and untied embeddings, biases on and off, and the
RoPE variants (Llama 3 scaling at positions where its scaled frequencies matter)."""

import pytest
import torch
from engine_testlib import (
    FAMILIES,
    VARIANTS,
    greedy,
    make_engine,
    prompts,
    run_all,
    tiny_config,
    tiny_model,
)

from dorarl.engine import SamplingParams

ARCHS = list(FAMILIES)
LLAMA3_ROPE = VARIANTS["llama-tied-bias-llama3rope"]["rope_parameters"]


def _hf_logprobs(
    model, prompt: list[int], output: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """Teacher-forced logprobs of `output` under the HF model (logits / temperature)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, dim=-1)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_and_logprobs_match_hf_in_mixed_batches(variant):
    model = tiny_model(variant, seed=1)
    # Chunk size 8 < most prompts, so prefill is chunked and decodes share steps with chunks.
    engine = make_engine(model, prefill_chunk_size=8, max_num_seqs=4)
    batch = prompts([3, 17, 9, 30, 1, 12], seed=2)
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, greedy(10 + 3 * i))
    outs = run_all(engine)
    for i, p in enumerate(batch):
        out = outs[f"r{i}"]
        ref = _hf_logprobs(model, p, out.output_ids)
        assert out.output_ids == ref.argmax(-1).tolist(), f"request {i}"
        got = torch.tensor(out.logprobs)
        want = ref.gather(1, torch.tensor(out.output_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_generate(arch):
    model = tiny_model(arch, seed=1)
    engine = make_engine(model)
    batch = prompts([5, 11, 2], seed=3)
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, greedy(16))
    outs = run_all(engine)
    for i, p in enumerate(batch):
        with torch.no_grad():
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(
                    ids
                ),  # else HF masks prompt tokens equal to pad_token_id
                max_new_tokens=16,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert outs[f"r{i}"].output_ids == gen[0, len(p) :].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_sampled_logprobs_are_under_the_tempered_distribution(arch):
    model = tiny_model(arch, seed=1)
    engine = make_engine(model)
    batch = prompts([7, 13], seed=4)
    for i, p in enumerate(batch):
        engine.add_request(
            f"r{i}",
            p,
            SamplingParams(temperature=0.7, max_new_tokens=12, stop_token_ids=[], seed=i),
        )
    outs = run_all(engine)
    for i, p in enumerate(batch):
        out = outs[f"r{i}"]
        ref = _hf_logprobs(model, p, out.output_ids, temperature=0.7)
        want = ref.gather(1, torch.tensor(out.output_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_state_dict_round_trips_hf_names(variant):
    model = tiny_model(variant, seed=1)
    engine = make_engine(model)
    ours = engine.state_dict()
    theirs = dict(model.state_dict())
    if model.config.tie_word_embeddings:  # HF lists the tied output layer; it is the embedding
        assert torch.equal(theirs.pop("lm_head.weight"), theirs["model.embed_tokens.weight"])
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


def _teacher_forced(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    ref = _hf_logprobs(model, prompt, output)
    return ref.gather(1, torch.tensor(output)[:, None]).squeeze(1)


def test_llama3_rope_scaling_matches_hf_at_long_positions():
    """Positions up to 210, far past original_max_position_embeddings (64) / factor (8): the
    scaled low frequencies turn by whole radians there, so a plain-RoPE engine would fail.
    The same weights under plain RoPE (the twin) show that this test can tell."""
    torch.manual_seed(3)
    scaled = FAMILIES["llama"][1](tiny_config("llama", rope_parameters=LLAMA3_ROPE)).eval()
    plain_rope = {"rope_type": "default", "rope_theta": LLAMA3_ROPE["rope_theta"]}
    twin = FAMILIES["llama"][1](tiny_config("llama", rope_parameters=plain_rope)).eval()
    twin.load_state_dict(scaled.state_dict())
    engine = make_engine(scaled)
    prompt = prompts([150], seed=5)[0]
    engine.add_request("long", prompt, greedy(60))
    out = run_all(engine)["long"]
    want = _teacher_forced(scaled, prompt, out.output_ids)
    assert out.output_ids == _hf_logprobs(scaled, prompt, out.output_ids).argmax(-1).tolist()
    torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=1e-4, rtol=0)
    unscaled = _teacher_forced(twin, prompt, out.output_ids)
    assert (want - unscaled).abs().max() > 1e-3  # 10x the tolerance above


@pytest.mark.parametrize("arch", ARCHS)
def test_requests_on_shared_prefix_blocks_match_hf(arch):
    """Samples of one prompt and prompts that share a system prefix read the prefix cache's
    blocks (and copy its partial last one): their logprobs are still HF's."""
    model = tiny_model(arch, seed=1)
    engine = make_engine(model, prefill_chunk_size=16)
    system, tails = prompts([22], seed=5)[0], prompts([5, 9], seed=6)
    batch = [system + tails[0]] * 3 + [system + tails[1]] * 2
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, greedy(8))
    outs = run_all(engine)
    assert engine.stats().prefill_saved_tokens == 2 * 26 + 20 + 30  # system: 5 blocks
    for i, p in enumerate(batch):
        out = outs[f"r{i}"]
        ref = _hf_logprobs(model, p, out.output_ids)
        assert out.output_ids == ref.argmax(-1).tolist(), f"request {i}"
        want = ref.gather(1, torch.tensor(out.output_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=1e-4, rtol=0)
