"""Real models' shapes that the benchmarks build with random weights (no download)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dorarl.errors import UserInputError

SHAPES: dict[str, dict[str, Any]] = {
    # SmolLM2-135M-Instruct: a Llama with tied embeddings and a 49k vocabulary
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "tiny": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        tie_word_embeddings=True,
        max_position_embeddings=512,
    ),
}


def random_llama(shape: str, seed: int = 0) -> LlamaForCausalLM:
    """A float32 Llama of `shape` with seeded random weights; an unknown name is one line."""
    if shape not in SHAPES:
        raise UserInputError(f"--shape: unknown shape {shape!r} (known: {', '.join(SHAPES)})")
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**SHAPES[shape]))
