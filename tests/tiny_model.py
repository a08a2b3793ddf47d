"""Tiny random Llamas saved as HF folders for tests: with the built-in character tokenizer,
or with a character tokenizer that has ChatML special tokens and a chat template."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from dorarl.tasks.chartok import CHARACTERS, build_char_tokenizer

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
# ChatML as SmolLM2-Instruct writes it, default system message included.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_chat_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character, plus ChatML's special tokens; EOS is <|im_end|>."""
    specials = [ENDOFTEXT, IM_START, IM_END]
    vocab = {token: i for i, token in enumerate(specials + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=ENDOFTEXT))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True) for t in specials])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=IM_END, pad_token=ENDOFTEXT, unk_token=ENDOFTEXT
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def save_tiny_model(folder: Path, seed: int = 0, max_len: int = 256, chat: bool = False) -> Path:
    tokenizer = build_chat_tokenizer() if chat else build_char_tokenizer()
    tokenizer.save_pretrained(str(folder))
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
