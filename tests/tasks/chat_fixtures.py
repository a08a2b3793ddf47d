"""Chat tokenizers for the conversation tests: byte-level BPEs trained here with each model
family's special and added tokens, and the families' published chat templates
(chat_templates/*.jinja, as their tokenizer_config.json carries them; ChatML is SmolLM2's,
tests/tiny_model.py)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from tiny_model import CHATML_TEMPLATE
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

TEMPLATES = Path(__file__).parent / "chat_templates"
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_ADDED = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]  # fmt: skip
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]  # fmt: skip

ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]},
}}  # fmt: skip
LOOKUP = {"name": "lookup", "description": "Look a word up.", "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}  # fmt: skip
TOOLS = [ADD, LOOKUP]

CORPUS = [
    "What is 12 plus 30? Let me add them with the tool.",
    '{"name": "add", "arguments": {"a": 12, "b": 30}}',
    '{"name": "add", "parameters": {"a": 12, "b": 30}}',
    "The answer is 42. The sum is forty-two, thanks for asking.",
    "You are a helpful assistant. Cutting Knowledge Date: December 2023",
    "hello world, hello there; say hello",
] * 8


def _tokenizer(special: list[str], added: list[str], **roles: str) -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    core.train_from_iterator(CORPUS, trainer=trainer)
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    return PreTrainedTokenizerFast(tokenizer_object=core, **roles)


@functools.cache
def qwen_tokenizer() -> PreTrainedTokenizerFast:
    return _tokenizer(QWEN_SPECIAL, QWEN_ADDED, eos_token="<|im_end|>", pad_token="<|endoftext|>")


@functools.cache
def llama3_tokenizer() -> PreTrainedTokenizerFast:
    return _tokenizer(
        LLAMA3_SPECIAL, [], bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
        pad_token="<|end_of_text|>",
    )  # fmt: skip


def chat_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """A fresh copy (tests may set its template) of `family`'s tokenizer: chatml, qwen2_5,
    qwen3, llama3_1."""
    base = llama3_tokenizer() if family == "llama3_1" else qwen_tokenizer()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(base.backend_tokenizer.to_str()),
        **{k: v for k, v in base.special_tokens_map.items() if isinstance(v, str)},
    )
    tokenizer.name_or_path = f"tests/{family}"
    tokenizer.chat_template = (
        CHATML_TEMPLATE if family == "chatml" else (TEMPLATES / f"{family}.jinja").read_text()
    )
    return tokenizer


def ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stop_ids(tokenizer: PreTrainedTokenizerFast, family: str) -> list[int]:
    """The family's end-of-turn tokens, as its generation config lists them."""
    names = ["<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"] if family == "llama3_1" else ["<|im_end|>", "<|endoftext|>"]  # fmt: skip
    return tokenizer.convert_tokens_to_ids(names)


def call_text(family: str, name: str, arguments: dict) -> str:
    """A call as the family's model writes it."""
    if family == "llama3_1":
        return json.dumps({"name": name, "parameters": arguments})
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"
