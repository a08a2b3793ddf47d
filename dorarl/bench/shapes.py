"""Real models' shapes that the benchmarks build with random weights (no download)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

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
    # Qwen2-0.5B and Qwen2.5-7B (the GPU bench's shapes): q/k/v biases, untied 7B head
    "qwen2-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
    ),
    "qwen2.5-7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
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


QWEN2_SHAPES = {"qwen2-0.5b", "qwen2.5-7b"}  # the rest are Llamas


def random_llama(
    shape: str, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> PreTrainedModel:
    """A model of `shape` (its family: Llama, or Qwen2 for the Qwen shapes) with seeded
    random weights, built on `device` in `dtype` (a 7B never exists in float32 on the host);
    an unknown name is one line."""
    if shape not in SHAPES:
        raise UserInputError(f"--shape: unknown shape {shape!r} (known: {', '.join(SHAPES)})")
    config_cls, model_cls = (
        (Qwen2Config, Qwen2ForCausalLM)
        if shape in QWEN2_SHAPES
        else (LlamaConfig, LlamaForCausalLM)
    )
    torch.manual_seed(seed)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return model_cls(config_cls(**SHAPES[shape]))
    finally:
        torch.set_default_dtype(before)
