"""Real models' shapes that the benchmarks build with random weights (no download): Llamas,
Qwen2s and one Mixture-of-Experts model, Qwen3-30B-A3B (the device bench's MoE shape)."""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from dorarl.engine.model_spec import spec_from_hf
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
    # Qwen3-30B-A3B: 128 experts of width 768, 8 a token (renormalised), every layer sparse,
    # q/k norms, untied: 30.5B parameters, 3.3B active
    "qwen3-30b-a3b": dict(
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        bos_token_id=151643,
        eos_token_id=151645,
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
    # the MoE shape's family at the tiny size, for the CPU runs of the device bench
    "tiny-moe": dict(
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        tie_word_embeddings=True,
        max_position_embeddings=512,
    ),
}


QWEN2_SHAPES = {"qwen2-0.5b", "qwen2.5-7b"}
MOE_SHAPES = {"qwen3-30b-a3b", "tiny-moe"}
_CLASSES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
}


def _family(shape: str) -> str:
    if shape in MOE_SHAPES:
        return "qwen3_moe"
    return "qwen2" if shape in QWEN2_SHAPES else "llama"


def shape_config(shape: str) -> PretrainedConfig:
    """The transformers config of `shape` (no weights); an unknown name is one line."""
    if shape not in SHAPES:
        raise UserInputError(f"--shape: unknown shape {shape!r} (known: {', '.join(SHAPES)})")
    return _CLASSES[_family(shape)][0](**SHAPES[shape])


def random_llama(
    shape: str, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> PreTrainedModel:
    """A model of `shape` (its family: Llama, Qwen2 for the Qwen2 shapes, Qwen3-MoE for the MoE
    one) with seeded random weights, built on `device` in `dtype` (a 7B never exists in
    float32 on the host); an unknown name is one line."""
    config = shape_config(shape)
    _check_host_memory(shape, config, device, dtype)
    torch.manual_seed(seed)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return _CLASSES[_family(shape)][1](config)
    finally:
        torch.set_default_dtype(before)


def meta_model(shape: str) -> PreTrainedModel:
    """A model of `shape` on the meta device: its names and shapes, no memory."""
    with torch.device("meta"):
        return _CLASSES[_family(shape)][1](shape_config(shape))


def _check_host_memory(shape: str, config: PretrainedConfig, device: str, dtype: torch.dtype):
    """One line, not an out-of-memory kill, for weights the host cannot hold."""
    if torch.device(device).type != "cpu":
        return
    need = spec_from_hf(config).num_parameters() * torch.empty((), dtype=dtype).element_size()
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > free:
        raise UserInputError(
            f"--shape {shape}: {need / 1e9:.1f} GB of weights in {dtype} do not fit the "
            f"{free / 1e9:.1f} GB of free host memory (it is a --device cuda shape)"
        )
