"""A tiny random Llama with the built-in character tokenizer, saved as a HF folder for tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dorarl.tasks.chartok import build_char_tokenizer, save_char_tokenizer


def save_tiny_model(folder: Path, seed: int = 0, max_len: int = 256) -> Path:
    tokenizer = build_char_tokenizer()
    save_char_tokenizer(folder)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_len,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # a strong EOS bias gives varied, long-tailed response lengths
        model.lm_head.weight[tokenizer.eos_token_id] *= 4
    model.save_pretrained(folder)
    return folder
