"""The rollout engine: paged-KV continuous batching with exact logprobs, migration and offload.

Public API: `Engine`, `EngineConfig`, `SamplingParams`, `RequestOutput`, `RequestSnapshot`,
`EngineStats`. Layout: sequence (request state), block_manager (block ids, torch-free),
scheduler (who runs, torch-free), kv_cache (pool tensors), attention, model, sampler,
model_runner (batch -> tensors -> tokens), engine (schedule, run, postprocess).
"""

from dorarl.engine.config import EngineConfig, SamplingParams
from dorarl.engine.engine import Engine
from dorarl.engine.outputs import EngineStats, RequestOutput, RequestSnapshot

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineStats",
    "RequestOutput",
    "RequestSnapshot",
    "SamplingParams",
]
