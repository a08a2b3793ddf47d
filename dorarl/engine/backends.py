"""Which attention, sampler, decode graphs and dtype an engine runs, resolved for its device.

`auto` means the fast path on cuda (Triton paged attention, sampling on the device, CUDA
graphs of decode, bfloat16) and today's path on the CPU (attention.py with its decode rows on
the fused C++ kernel where it builds and fits the model, sampler.py, no graphs, float32).
`EngineConfig.validate` has refused the combinations that cannot work; `fit_to_model`
refuses an explicit choice the model's head shape cannot run (the driver calls it before
any actor starts) and moves `auto` to the torch path, in one log line.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from dataclasses import dataclass

import torch

from dorarl.config import ConfigError
from dorarl.engine import cpu_kernels
from dorarl.engine.config import TRITON_MIN, EngineConfig, triton_unfit

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
    attention = _attention(config, on_cuda, dtype_name == "float32")
    sampler = config.sampler if config.sampler != "auto" else ("device" if on_cuda else "host")
    graphs = config.cuda_graphs == "on" or (
        config.cuda_graphs == "auto" and on_cuda and attention == "triton"
    )
    return Backends(attention, sampler, graphs, getattr(torch, dtype_name))


def fit_to_model(
    backends: Backends,
    config: EngineConfig,
    head_dim: int,
    queries_per_kv: int,
    where: str = "the model",
    experts: bool = False,
) -> Backends:
    """`backends` for a model of this head shape (read from `where`) and, with `experts`, of
    expert layers (their routing is data-dependent: decode runs eagerly, no graphs): an
    explicit choice it cannot run is refused (`refuse_unfit`), `auto` falls back in one log
    line."""
    refuse_unfit(config, head_dim, queries_per_kv, where, experts)
    if experts and backends.cuda_graphs:
        logger.info("engine.cuda_graphs=auto: %s has expert layers: eager decode", where)
        backends = dataclasses.replace(backends, cuda_graphs=False)
    if backends.attention == "cpp" and not cpu_kernels.supports(
        head_dim, queries_per_kv, backends.dtype
    ):
        shape = f"head_dim {head_dim}, {queries_per_kv} query heads per kv head"
        logger.info("engine.attention=auto: the fused CPU kernel does not fit %s: torch", shape)
        return dataclasses.replace(backends, attention="torch")
    if backends.attention == "triton" and triton_unfit(config.block_size, head_dim):
        logger.warning(
            "engine.attention=auto: Triton attention needs head_dim a power of two >= %d, "
            "%s has %d: torch", TRITON_MIN, where, head_dim,
        )  # fmt: skip
        return dataclasses.replace(backends, attention="torch", cuda_graphs=False)
    return backends


def refuse_unfit(
    config: EngineConfig, head_dim: int, queries_per_kv: int, where: str, experts: bool = False
) -> None:
    """One line naming the key when an explicit choice cannot run this model's heads: the
    fused CPU kernel covers head_dim 16-256 in powers of two and up to 32 query heads per kv
    head, the Triton kernels head dims that are powers of two >= 16; decode graphs are not
    captured for expert layers. Pure: the driver calls it with the model's config before any
    engine starts."""
    if experts and config.cuda_graphs == "on":
        raise ConfigError(
            f"engine.cuda_graphs: on is not supported for {where}: its expert layers route "
            "each step's tokens anew (engine.cuda_graphs=auto decodes eagerly)"
        )
    if config.attention == "cpp" and not cpu_kernels.supports(
        head_dim, queries_per_kv, torch.float32
    ):
        raise ConfigError(
            f"engine.attention: cpp takes head_dim in {cpu_kernels.HEAD_DIMS} and at most "
            f"{cpu_kernels.MAX_QUERIES_PER_KV} query heads per kv head; {where} has head_dim "
            f"{head_dim}, {queries_per_kv} query heads per kv head"
        )
    if triton_unfit(config.block_size, head_dim) is None:
        return
    for key, value in (("attention", "triton"), ("cuda_graphs", "on")):
        if getattr(config, key) == value:
            raise ConfigError(
                f"engine.{key}: {value} needs head_dim a power of two >= {TRITON_MIN} (the "
                f"Triton kernels' tiles); {where} has head_dim {head_dim} "
                "(engine.attention=torch runs it)"
            )


def _attention(config: EngineConfig, on_cuda: bool, float32: bool) -> str:
    choice = config.attention
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
    unfit = triton_unfit(config.block_size)
    if unfit:
        logger.warning(
            "engine.attention=auto: Triton attention needs a block size that is a power of two "
            ">= %d, engine.block_size is %d: torch", TRITON_MIN, config.block_size,
        )  # fmt: skip
        return "torch"
    return "triton"
