"""The rollout engine: paged-KV continuous batching with exact logprobs, migration and offload.

Public API: `Engine`, `EngineConfig`, `SamplingParams`, `RequestOutput`, `RequestSnapshot`,
`EngineStats`, `StepWork`. Layout: token_ids (user token ids, checked), sequence (request
state), block_manager (block ids, torch-free), scheduler (who runs, torch-free), kv_cache
(pool tensors), attention, linear (the matmul kernel), model, sampler, model_runner (batch ->
tensors -> tokens), engine (`Engine`: its start, made of engine_intake (requests in),
engine_step (schedule, run, postprocess), engine_turns (multi-turn), engine_migration
(export, import, resume, abort), engine_versions (weights, adapters), engine_reports).
Importing the package, `SamplingParams`, the outputs or the scheduler does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dorarl.engine.config import EngineConfig, SamplingParams
    from dorarl.engine.engine import Engine
    from dorarl.engine.outputs import EngineStats, RequestOutput, RequestSnapshot, StepWork

# Lazy exports: the controller and simulator use the plain types without importing torch.
_HOMES = {
    "Engine": "dorarl.engine.engine",
    "EngineConfig": "dorarl.engine.config",
    "SamplingParams": "dorarl.engine.config",
    "EngineStats": "dorarl.engine.outputs",
    "RequestOutput": "dorarl.engine.outputs",
    "RequestSnapshot": "dorarl.engine.outputs",
    "StepWork": "dorarl.engine.outputs",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'dorarl.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)


__all__ = [
    "Engine",
    "EngineConfig",
    "EngineStats",
    "RequestOutput",
    "RequestSnapshot",
    "SamplingParams",
    "StepWork",
]
