"""The engine a rollout instance runs, by `engine.backend`: ours, or one vLLM engine. Both
answer `InstanceEngine` (interface.py); callers plan by `config.capabilities`."""

from __future__ import annotations

from pathlib import Path

from dorarl.engine.config import EngineConfig
from dorarl.engine.interface import InstanceEngine


def open_engine(folder: str | Path, config: EngineConfig, version: int = 0) -> InstanceEngine:
    """An engine on a local Hugging Face folder hosting `version` (vllm imported only for
    backend vllm)."""
    if config.backend == "vllm":
        from dorarl.engine.vllm.engine import VllmEngine

        return VllmEngine.from_pretrained(folder, config, version)
    from dorarl.engine.engine import Engine

    return Engine.from_pretrained(folder, config, version=version)


def close_engine(engine: InstanceEngine | None) -> None:
    """Free an engine's memory now (a vLLM engine's core is stopped; ours goes with its
    last reference)."""
    close = getattr(engine, "close", None)
    if close is not None:
        close()
