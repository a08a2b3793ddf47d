"""Tiny reward models saved as HF folders (safetensors) for tests, with the shipped base
model's character tokenizer: a random sequence classifier of one label, a random causal-LM
judge, and a classifier set by hand so that its score is the `exact` verifier's on a one-
character answer (1.0 when the text's last character is `target`, else 0.0)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from dorarl.tasks.assets import shipped_base_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _config(**extra) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=101, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, **extra,
    )  # fmt: skip


def _with_tokenizer(folder: Path) -> Path:
    for name in TOKENIZER_FILES:
        shutil.copy(shipped_base_model() / name, folder / name)
    return folder


def save_classifier(folder: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(_config(num_labels=1))
    model.save_pretrained(folder, safe_serialization=True)
    return _with_tokenizer(folder)


def save_judge(folder: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    LlamaForCausalLM(_config()).save_pretrained(folder, safe_serialization=True)
    return _with_tokenizer(folder)


def save_exact_classifier(folder: Path, target_id: int) -> Path:
    """A classifier whose score is 1.0 when the text's last token is `target_id`, else 0.0:
    its layer writes nothing to the residual (the last token's embedding reaches the head),
    the target's embedding is e0 and every other token's e1, the head reads e0 alone."""
    model = LlamaForSequenceClassification(_config(num_labels=1, rms_norm_eps=1e-12))
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        model.model.norm.weight.fill_(1.0)
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        embed = model.model.embed_tokens.weight
        embed[:, 1] = 1.0
        embed[target_id] = 0.0
        embed[target_id, 0] = 1.0
        # RMS-normed e0 is 4 x e0 (hidden 16): a head of 1/4 on it scores exactly 1.
        model.score.weight[0, 0] = 0.25
    model.save_pretrained(folder, safe_serialization=True)
    return _with_tokenizer(folder)


def lean_towards(folder: Path, target_id: int, prompts: list[str], share: float = 0.2) -> Path:
    """The policy in `folder` (a causal LM) made to write `target_id` first about `share`
    of the time on `prompts`: its output row for the token set along their mean last hidden
    state, scaled by bisection."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        states = [
            model(**tokenizer(p, return_tensors="pt"), output_hidden_states=True).hidden_states[-1][
                0, -1
            ]
            for p in prompts
        ]
        direction = torch.stack(states).mean(0)
        direction /= direction.norm()
        low, high = 0.0, 100.0
        for _ in range(40):
            model.lm_head.weight[target_id] = direction * (low + high) / 2
            chance = sum(
                model(**tokenizer(p, return_tensors="pt")).logits[0, -1].softmax(-1)[target_id]
                for p in prompts
            ) / len(prompts)
            low, high = ((low + high) / 2, high) if chance < share else (low, (low + high) / 2)
    model.save_pretrained(folder, safe_serialization=True)
    return folder
