"""The context a run's engines get when `engine.max_model_len` is not given: the model's.

A model folder of one's own takes its config.json's `max_position_embeddings`, at most
2048 tokens on cpu engines and 8192 on cuda. A user's prompts (a system prompt, tool
descriptions, a few-shot example) and replies then fit without a key to find, where a
fixed 256 cut them silently. The caps bound what one sequence costs where the model allows
far more (Qwen2.5's 32768): every engine reserves KV for its `engine.max_num_seqs`
full-length sequences up to its memory share, and the trainer's activations grow with
the longest sequence. 2048 covers a long prompt and a 1024-token reply at CPU speed;
8192 the usual GRPO recipes on a GPU (prompt up to 2048, reply up to 4096-6144). The
shipped base models (assets/, a 512-position model trained for its tasks) keep 256, what
their tasks need, so the built-in runs cost what they did. An explicit
`engine.max_model_len` (command line, config file, a resumed run's config.json) is kept.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from dorarl.jobs.config import TrainConfig

CONTEXT_KEY = "engine.max_model_len"
CONTEXT_CAP = {"cpu": 2048, "cuda": 8192}


def context_given(file_tree: dict[str, Any], overrides: list[str]) -> bool:
    """Whether the config file (`file_tree`, as read) or an override sets the context."""
    keys = {item.partition("=")[0].strip() for item in overrides if "=" in item}
    engine = file_tree.get("engine")
    in_file = isinstance(engine, dict) and "max_model_len" in engine
    return in_file or bool(keys & {CONTEXT_KEY, "engine"})


def is_shipped_model(folder: str | Path) -> bool:
    from dorarl.tasks.assets import ASSETS  # dorarl.tasks imports transformers: not at load

    return Path(folder).resolve().is_relative_to(ASSETS.resolve())


def model_context(folder: str | Path, device: str) -> int:
    """The context for the model in `folder` on `device` engines (the rule above)."""
    cap = CONTEXT_CAP["cpu" if device == "cpu" else "cuda"]
    try:
        declared = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return cap  # an unreadable folder is refused, naming it, when the run reads it
    positions = declared.get("max_position_embeddings")
    return min(positions, cap) if isinstance(positions, int) and positions > 0 else cap


def with_model_context(config: TrainConfig) -> TrainConfig:
    """`config` with the context its model calls for; the shipped base models' runs (no
    `model=`, or a folder under assets/) and sim runs keep the default."""
    if config.runtime != "ray" or config.model is None or is_shipped_model(config.model):
        return config
    engine = config.engine
    context = model_context(config.model, engine.device)
    if engine.num_blocks is not None:  # a pool given in blocks holds one full sequence
        context = min(context, engine.num_blocks * engine.block_size)
    if context == engine.max_model_len:
        return config
    return dataclasses.replace(config, engine=dataclasses.replace(engine, max_model_len=context))


def context_line(config: TrainConfig) -> str | None:
    """The start's line on a model folder's context (None for the shipped base models)."""
    if config.model is None or is_shipped_model(config.model):
        return None
    return (
        f"{CONTEXT_KEY}: {config.engine.max_model_len} tokens of prompt and reply (by default "
        f"the model's max_position_embeddings, at most {CONTEXT_CAP['cpu']} on cpu engines, "
        f"{CONTEXT_CAP['cuda']} on cuda; {CONTEXT_KEY}=N sets another)"
    )
