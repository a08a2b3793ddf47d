"""Which attention, sampler, decode graphs and dtype an engine runs, resolved for its device.

`auto` means the fast path on cuda (Triton paged attention, sampling on the device, CUDA
graphs of decode, bfloat16) and today's path on the CPU (attention.py, sampler.py, no
graphs, float32). `EngineConfig.validate` has refused the combinations that cannot work.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch

from dorarl.engine.config import EngineConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backends:
    attention: str  # triton | torch
    sampler: str  # device | host
    cuda_graphs: bool
    dtype: torch.dtype

    @property
    def fast(self) -> bool:
        """Anything but today's CPU path (which `model_runner.ModelRunner` runs alone)."""
        return self.attention == "triton" or self.sampler == "device" or self.cuda_graphs


def resolve_backends(config: EngineConfig) -> Backends:
    on_cuda = torch.device(config.device).type == "cuda"
    attention = _attention(config.attention, on_cuda)
    sampler = config.sampler if config.sampler != "auto" else ("device" if on_cuda else "host")
    graphs = config.cuda_graphs == "on" or (
        config.cuda_graphs == "auto" and on_cuda and attention == "triton"
    )
    dtype_name = config.dtype if config.dtype != "auto" else ("bfloat16" if on_cuda else "float32")
    return Backends(attention, sampler, graphs, getattr(torch, dtype_name))


def _attention(choice: str, on_cuda: bool) -> str:
    if choice != "auto":
        return choice
    if not on_cuda:
        return "torch"
    if importlib.util.find_spec("triton") is None:
        logger.warning("engine.attention=auto: triton is not installed, cuda runs attention.py")
        return "torch"
    return "triton"
