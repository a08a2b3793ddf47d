"""What a task reads from a model folder: its tokenizer, its stop tokens, its context limit."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from dorarl.errors import UserInputError
from dorarl.tasks.assets import shipped_base_model

VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
"""A fast tokenizer's file, or a slow one's vocabulary (vocab.json goes with merges.txt)."""


def load_tokenizer(
    source: str | Path | PreTrainedTokenizerBase | None,
) -> tuple[PreTrainedTokenizerBase, Path | None]:
    """The tokenizer and the folder it came from (None for a tokenizer object)."""
    if isinstance(source, PreTrainedTokenizerBase):
        return source, None
    folder = Path(source) if source is not None else shipped_base_model()
    try:
        return AutoTokenizer.from_pretrained(str(folder)), folder
    except (OSError, ValueError) as exc:
        missing = missing_tokenizer_files(folder)
        reason = missing or " ".join(str(exc).split())  # transformers' own: several lines
        raise UserInputError(f"{folder}: cannot load a tokenizer: {reason}") from None


def load_chat_tokenizer(
    source: str | Path | PreTrainedTokenizerBase | None, task: str
) -> tuple[PreTrainedTokenizerBase, Path | None]:
    """`load_tokenizer` for a task that renders chat messages: a tokenizer without a chat
    template is refused, naming the task and the model."""
    tokenizer, folder = load_tokenizer(source)
    if not getattr(tokenizer, "chat_template", None):
        model = folder if folder is not None else "the given tokenizer"
        raise UserInputError(
            f"task.name={task} needs a chat model (a tokenizer with a chat template); "
            f"{model} has none"
        )
    return tokenizer, folder


def missing_tokenizer_files(folder: Path) -> str | None:
    """The tokenizer files a model folder lacks, in words; None when it has a vocabulary
    (another tokenizer's file, sentencepiece's *.model or tiktoken's, counts as one)."""
    vocabularies = [*VOCABULARY_FILES, "*.model", "*.tiktoken"]
    if any(any(folder.glob(pattern)) for pattern in vocabularies):
        return None
    lacks = f"none of {', '.join(VOCABULARY_FILES)}"
    if not (folder / "tokenizer_config.json").is_file():
        lacks = f"no tokenizer_config.json and {lacks}"
    return f"{lacks}; copy the tokenizer files from the folder its weights came from"


def stop_ids(tokenizer: PreTrainedTokenizerBase, model_dir: Path | None) -> list[int]:
    """EOS of the tokenizer plus the model's generation EOS ids (chat models have several)."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if model_dir is not None and (model_dir / "generation_config.json").exists():
        eos = GenerationConfig.from_pretrained(str(model_dir)).eos_token_id
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    if not ids:
        raise UserInputError("the tokenizer has no EOS token and the model names none")
    return sorted(set(ids))


def context_limit(model_dir: Path | None, tokenizer: PreTrainedTokenizerBase) -> int:
    if model_dir is not None and (model_dir / "config.json").exists():
        config = json.loads((model_dir / "config.json").read_text())
        if "max_position_embeddings" in config:
            return int(config["max_position_embeddings"])
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and limit < 10**9:
        return limit
    raise UserInputError(
        "cannot tell the model's context limit (its config.json has no max_position_embeddings); "
        "set engine.max_model_len"
    )
