"""Tiny random models saved as HF folders for tests: Llamas with the built-in character
tokenizer or a ChatML character tokenizer, and Qwen2 / Qwen3 / Qwen3-MoE / Llama 3 folders
with a byte-level BPE tokenizer trained here (what a user's model folder looks like)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

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


def gsm8k_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    """GSM8K-shaped rows (question; worked answer ending in `#### N`) of one-step sums."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        question = f"Sam has {a} apples and buys {b} more. How many apples does Sam have now?"
        answer = f"Sam has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}"
        rows.append({"question": question, "answer": answer})
    return rows


def build_bpe_chat_tokenizer(corpus: list[str], vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained here on `corpus` (as Qwen's and Llama 3's tokenizers are
    byte-level BPEs), with ChatML's special tokens and chat template; EOS is <|im_end|>."""
    specials = [ENDOFTEXT, IM_START, IM_END]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=IM_END, pad_token=ENDOFTEXT, unk_token=None
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


FAMILY_CONFIGS = {
    "qwen2": lambda **kw: Qwen2Config(tie_word_embeddings=True, **kw),  # Qwen2.5 0.5B-3B tie
    "qwen3": lambda **kw: Qwen3Config(head_dim=16, **kw),
    "qwen3_moe": lambda **kw: Qwen3MoeConfig(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **kw
    ),
    "llama3": lambda **kw: LlamaConfig(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        **kw,
    ),
}


def save_family_model(folder: Path, family: str, corpus: list[str], seed: int = 0) -> Path:
    """A random model of `family` (qwen2, qwen3, qwen3_moe, llama3) saved with
    `save_pretrained`, with a BPE chat tokenizer trained on `corpus`: the shape of a user's
    Hugging Face folder."""
    tokenizer = build_bpe_chat_tokenizer(corpus)
    tokenizer.save_pretrained(str(folder))
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    config = FAMILY_CONFIGS[family](
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # some responses end early, others run into the cap
        model.get_output_embeddings().weight[eos] *= 6
    model.save_pretrained(folder)
    return folder


def save_with_head_dim(source: Path, folder: Path, head_dim: int) -> Path:
    """A copy of the model folder `source` whose config.json says `head_dim` (its weights
    keep their own): a config that does not match its weights, or one Triton cannot run."""
    folder.mkdir()
    for item in source.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "head_dim": head_dim}))
    return folder
