"""A tiny Llama with the built-in character tokenizer, saved as a HF folder, and groups for it."""

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dorarl.data import Group, Sample
from dorarl.tasks.chartok import build_char_tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama")
    tok = build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder


@pytest.fixture
def make_groups():
    return _make_groups


def _make_groups(
    seed: int, n_groups: int = 3, group_size: int = 4, version: int = 0, vocab: int = 100
) -> list[Group]:
    """Random groups with varied prompt/response lengths and made-up behavior logprobs."""
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        prompt = [1] + [rng.randrange(4, vocab) for _ in range(rng.randint(2, 9))]
        samples = []
        for i in range(group_size):
            n = rng.randint(1, 12)
            samples.append(
                Sample(
                    group_id=g,
                    sample_index=i,
                    prompt_id=g,
                    prompt_ids=prompt,
                    response_ids=[rng.randrange(4, vocab) for _ in range(n)],
                    logprobs=[-rng.uniform(3.0, 6.0) for _ in range(n)],
                    versions=[version] * n,
                    finish_reason="stop",
                    reward=float(rng.random() < 0.5),
                )
            )
        groups.append(Group(group_id=g, prompt_id=g, version=version, samples=samples))
    return groups
