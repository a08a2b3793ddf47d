"""Which attention, sampler, decode graphs and dtype an engine runs, resolved for its device.

`auto` means the fast path on cuda (Triton paged attention, sampling on the device, CUDA
graphs of decode, bfloat16) and today's path on the CPU (attention.py with its decode rows on
the fused C++ kernel where it builds and fits the model, sampler.py, no graphs, float32).
`EngineConfig.validate` has refused the combinations that cannot work.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from dataclasses import dataclass

import torch

from dorarl.config import ConfigError
from dorarl.engine import cpu_kernels
from dorarl.engine.config import EngineConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backends:
    attention: str  # triton | torch | cpp
    sampler: str  # device | host
    cuda_graphs: bool
    dtype: torch.dtype

    @property
    def fast(self) -> bool:
        """Anything but today's CPU path (which `model_runner.ModelRunner` runs alone)."""
        return self.attention == "triton" or self.sampler == "device" or self.cuda_graphs


def resolve_backends(config: EngineConfig) -> Backends:
    on_cuda = torch.device(config.device).type == "cuda"
    dtype_name = config.dtype if config.dtype != "auto" else ("bfloat16" if on_cuda else "float32")
    attention = _attention(config.attention, on_cuda, dtype_name == "float32")
    sampler = config.sampler if config.sampler != "auto" else ("device" if on_cuda else "host")
    graphs = config.cuda_graphs == "on" or (
        config.cuda_graphs == "auto" and on_cuda and attention == "triton"
    )
    return Backends(attention, sampler, graphs, getattr(torch, dtype_name))


def fit_to_model(
    backends: Backends, config: EngineConfig, head_dim: int, queries_per_kv: int
) -> Backends:
    """`backends` for a model of this head shape: the fused CPU kernel covers head_dim 16-256
    in powers of two and up to 32 query heads per kv head; `auto` falls back to torch."""
    if backends.attention != "cpp" or cpu_kernels.supports(
        head_dim, queries_per_kv, backends.dtype
    ):
        return backends
    shape = f"head_dim {head_dim}, {queries_per_kv} query heads per kv head"
    if config.attention == "cpp":
        raise ConfigError(
            f"engine.attention: cpp takes head_dim in {cpu_kernels.HEAD_DIMS} and at most "
            f"{cpu_kernels.MAX_QUERIES_PER_KV} query heads per kv head; the model has {shape}"
        )
    logger.info("engine.attention=auto: the fused CPU kernel does not fit %s: torch", shape)
    return dataclasses.replace(backends, attention="torch")


def _attention(choice: str, on_cuda: bool, float32: bool) -> str:
    if choice == "cpp" and cpu_kernels.load_kernels() is None:
        raise ConfigError(
            "engine.attention: cpp could not be built here (the log line above says why); "
            "engine.attention=torch runs without a compiler"
        )
    if choice != "auto":
        return choice
    if not on_cuda:
        return "cpp" if float32 and cpu_kernels.load_kernels() is not None else "torch"
    if importlib.util.find_spec("triton") is None:
        logger.warning("engine.attention=auto: triton is not installed, cuda runs attention.py")
        return "torch"
    return "triton"
