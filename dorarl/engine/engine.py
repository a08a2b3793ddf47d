"""The rollout engine `Engine`: its start (model, KV pool, fast paths checked on the device)
and the parts it is made of (engine_*.py: requests, step, turns, migration, versions, reports)."""

from __future__ import annotations

import dataclasses
import logging
import random
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import PretrainedConfig

from dorarl.config import ConfigError
from dorarl.engine import cpu_kernels
from dorarl.engine.backends import fit_to_model, resolve_backends
from dorarl.engine.block_manager import BlockManager
from dorarl.engine.capabilities import DORARL_CAPABILITIES
from dorarl.engine.config import EngineConfig
from dorarl.engine.device_runner import DeviceRunner, build_graphs
from dorarl.engine.engine_intake import RequestIntake
from dorarl.engine.engine_migration import Migration
from dorarl.engine.engine_reports import COUNTERS, Reports
from dorarl.engine.engine_step import Stepping
from dorarl.engine.engine_turns import Turns
from dorarl.engine.engine_versions import Versions
from dorarl.engine.host_memory import host_memory
from dorarl.engine.kv_cache import KVCache, KVShape
from dorarl.engine.linear import choose_kernel
from dorarl.engine.lora import ResidentAdapters
from dorarl.engine.memory import DEFAULT_SHARE, HOST_SHARE, KVPlan, plan_kv
from dorarl.engine.model import Transformer, rms_norm, rotate
from dorarl.engine.model_runner import ModelRunner
from dorarl.engine.model_spec import ModelSpec, read_hf_config, rope_tables, spec_from_hf
from dorarl.engine.outputs import FastPathFallback, StepWork
from dorarl.engine.preflight import check_triton_attention
from dorarl.engine.scheduler import Scheduler
from dorarl.engine.sequence import Sequence
from dorarl.engine.stop_strings import Decode, FolderDecoder
from dorarl.engine.weights import check_named, from_checkpoint, load_folder, pack, random_named

if TYPE_CHECKING:
    from dorarl.engine.decode_graphs import DecodeGraphs  # needs triton

logger = logging.getLogger(__name__)


class Engine(RequestIntake, Stepping, Turns, Migration, Versions, Reports):
    """The rollout engine: continuous batching over a paged KV pool, one full-weight version
    (and up to `engine.max_versions - 1` LoRA adapter versions over it, lora.py) at a time.

    A step reads as schedule, move KV, run, postprocess. Between steps the engine accepts new
    requests, continues multi-turn requests with an environment's observation (on the KV they
    kept: the history is not prefilled again) or opens a new segment of one (a fresh prompt,
    its KV computed anew, the request's output keeping every segment), exports and imports
    requests with their KV (same version only), resumes requests from tokens (any version),
    offloads KV to host memory, and swaps weights. With
    `engine.prefix_cache=on` requests of the hosted version read the KV blocks of prompt tokens
    another request computed (block_manager.py, prefix_cache.py); a weight load frees every
    cached block of the old weights first. Invariants: every
    sampled token is tagged with the version of the weights that sampled it; a bad request or
    a bad weight update raises `UserInputError` and leaves every other request and the current
    weights untouched. At start the engine checks its fast paths on its device (preflight.py;
    `auto` falls back to torch attention or eager decode, recorded in `setup()`) and, on cuda,
    sizes its KV pool from its share of the device's memory (memory.py).
    """

    capabilities = DORARL_CAPABILITIES

    def __init__(
        self,
        hf_config: PretrainedConfig,
        config: EngineConfig,
        named_weights: dict[str, torch.Tensor],
        version: int = 0,
        where: str = "hf_config",
        decode: Decode | None = None,
    ) -> None:
        self.config = config
        self.decode = decode  # token ids -> text, for requests with stop strings
        self.hf_config = hf_config
        self.spec: ModelSpec = spec_from_hf(hf_config, where)
        self.device = torch.device(config.device)
        queries_per_kv = self.spec.num_heads // self.spec.num_kv_heads
        self.backends = fit_to_model(
            resolve_backends(config), config, self.spec.head_dim, queries_per_kv, where,
            experts=self.spec.moe is not None,
        )  # fmt: skip
        if config.max_versions > 1:  # the captured step has no per-row adapters (config.py)
            self.backends = dataclasses.replace(self.backends, cuda_graphs=False)
        self.dtype: torch.dtype = self.backends.dtype
        self.version = version
        self.fallbacks: list[FastPathFallback] = []
        self.kernel = choose_kernel(config.linear_kernel, self.device, self.dtype)
        self.model = self._build_model(named_weights, where)
        # None with one version: the layers stay plain Linears, with nothing added per step
        self.adapters = self._adapters()
        if self.backends.attention == "triton":
            self._check_triton(queries_per_kv)
        self._make_kv_pool()
        self.scheduler = Scheduler(
            self.blocks, config.max_num_seqs, config.prefill_chunk_size,
            config.offload_threshold, config.prefix_cache == "on", version,
        )  # fmt: skip
        fused = self._cpu_kernels()
        self.record_routes = self._records_routes(where)
        self.runner = ModelRunner(
            self.model, self.kv, fused.decode if fused else None, self.record_routes
        )
        self.graphs = self._graphs() if self.backends.cuda_graphs else None
        if self.backends.fast:  # the GPU fast paths; the CPU default keeps ModelRunner alone
            self.runner = DeviceRunner(self.model, self.runner, self.backends, self.graphs)
        self._seqs: dict[str, Sequence] = {}
        self._detached: dict[str, torch.Tensor] = {}  # imported KV waiting for device blocks
        self._seed_rng = random.Random(config.seed)
        self._counters = dict.fromkeys(COUNTERS, 0)
        self.last_step = StepWork()  # what the latest `step` computed

    def _make_kv_pool(self) -> None:
        """The KV pool (on cuda: what its memory share holds) and its block manager."""
        config = self.config
        self.kv_plan = self._plan_pool()
        self.kv_blocks = config.kv_blocks if self.kv_plan is None else self.kv_plan.blocks
        shape = KVShape(
            self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim, config.block_size
        )
        # With graphs, one more block than the block manager hands out: padding rows' scratch.
        pool_blocks = self.kv_blocks + int(self.backends.cuda_graphs)
        self.kv = KVCache(shape, pool_blocks, config.host_blocks, self.device, self.dtype)
        self.blocks = BlockManager(self.kv_blocks, config.host_blocks, config.block_size)

    def _records_routes(self, where: str) -> bool:
        if self.config.record_routes and self.spec.moe is None:
            logger.warning(
                "engine.record_routes: %s has no expert layers; nothing to record", where
            )
        return self.config.record_routes and self.spec.moe is not None

    # --- fast paths and memory, at start ------------------------------------------------
    def _check_triton(self, queries_per_kv: int) -> None:
        """Triton attention against the torch path on a tiny pool of this model's shape."""
        s = self.spec
        try:
            check_triton_attention(
                s.num_kv_heads, s.head_dim, queries_per_kv, self.config.block_size,
                self.device, self.dtype,
            )  # fmt: skip
        except Exception as exc:  # any failure there: a compile error, a launch, wrong values
            self._fall_back("attention", "torch", exc)
            if self.config.cuda_graphs == "on":
                raise ConfigError(
                    "engine.cuda_graphs: on captures the Triton decode step, which failed its "
                    f"start-up check on {self.device}: {_one_line(exc)}"
                ) from exc
            self.backends = dataclasses.replace(self.backends, attention="torch", cuda_graphs=False)

    def _graphs(self) -> DecodeGraphs | None:
        """The decode graphs, captured and checked; None (eager decode) where that fails."""
        try:
            return build_graphs(self.model, self.kv, self.config, self.kv_blocks)
        except Exception as exc:
            self._fall_back("cuda_graphs", "off", exc)
            self.backends = dataclasses.replace(self.backends, cuda_graphs=False)
            return None

    def _fall_back(self, key: str, instead: str, exc: Exception) -> None:
        """`auto` chose a path that failed here: warn and record it. An explicit choice fails
        in one line: the user asked for that path."""
        error = _one_line(exc)
        asked = getattr(self.config, key)
        if asked != "auto":
            raise ConfigError(
                f"engine.{key}: {asked} failed its start-up check on {self.device}: {error}"
            ) from exc
        logger.warning(
            "engine.%s=auto: its fast path failed its start-up check on %s, running %s "
            "instead: %s", key, self.device, instead, error,
        )  # fmt: skip
        self.fallbacks.append(FastPathFallback(key, instead, error))

    def _plan_pool(self) -> KVPlan | None:
        """The pool its memory share holds (an explicit engine.num_blocks wins): on cuda its
        GPU share, on the CPU `HOST_SHARE` of the host memory the process may use; refused in
        one line when not even one max_model_len sequence fits."""
        memory = device_memory(self.device)
        if memory is None:
            return None
        free, total = memory
        default = DEFAULT_SHARE if self.device.type == "cuda" else HOST_SHARE
        share = self.config.gpu_memory_share or default
        elem = torch.empty((), dtype=self.dtype).element_size()
        plan = plan_kv(self.spec, self.config, elem, self.backends.cuda_graphs, total, share, free)
        if not plan.explicit and not plan.fits:
            raise ConfigError(self._shortfall(plan))
        logger.info("engine on %s: %s", self.device, plan.describe())
        return plan

    def _shortfall(self, plan: KVPlan) -> str:
        """Why the default pool cannot run here, naming the key that sizes it."""
        if self.device.type == "cuda" or self.config.gpu_memory_share is not None:
            return (
                f"engine.gpu_memory_share: {plan.shortfall()} on {self.device} (a larger "
                "share, ray.engine_gpus, a smaller engine.max_model_len or a smaller model)"
            )
        return (
            f"engine.num_blocks: unset, and on the CPU {plan.shortfall()} (set "
            "engine.num_blocks, a smaller engine.max_model_len or a smaller model)"
        )

    def _build_model(self, named_weights: dict[str, torch.Tensor], where: str) -> Transformer:
        check_named(self.spec, named_weights, f"{where}: weights")
        weights = pack(self.spec, named_weights, self.device, self.dtype, self.kernel)
        cos, sin = rope_tables(self.hf_config, self.spec, self.config.max_model_len)
        fused = self._cpu_kernels()
        return Transformer(
            self.spec,
            weights,
            cos.to(self.device, self.dtype),
            sin.to(self.device, self.dtype),
            norm=fused.rms_norm if fused else rms_norm,
            rope=fused.rope if fused else rotate,
        )

    def _adapters(self) -> ResidentAdapters | None:
        c = self.config
        if c.max_versions == 1:
            return None
        return ResidentAdapters(self.spec, self.model.weights, c.max_versions - 1, c.max_lora_rank)

    def _cpu_kernels(self) -> cpu_kernels.CpuKernels | None:
        """engine.attention=cpp: decode attention, RMSNorm and RoPE on the fused C++ kernels."""
        return cpu_kernels.load_kernels() if self.backends.attention == "cpp" else None

    # --- construction ---------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, folder: str | Path, config: EngineConfig, version: int = 0) -> Engine:
        """Load a local Hugging Face folder (config.json + *.safetensors)."""
        hf_config = read_hf_config(folder)
        where = str(Path(folder) / "config.json")
        named = from_checkpoint(spec_from_hf(hf_config, where), load_folder(folder))
        return cls(hf_config, config, named, version, where, FolderDecoder(str(folder)))

    @classmethod
    def from_hf_config(
        cls,
        hf_config: PretrainedConfig,
        config: EngineConfig,
        state_dict: dict[str, torch.Tensor] | None = None,
        version: int = 0,
        seed: int = 0,
        decode: Decode | None = None,
    ) -> Engine:
        """Build from a transformers config, with its state dict or a seeded random init;
        `decode` (token ids -> text) serves requests with stop strings."""
        if state_dict is None:
            std = getattr(hf_config, "initializer_range", 0.02)
            state_dict = random_named(spec_from_hf(hf_config), seed, std)
        return cls(hf_config, config, state_dict, version, decode=decode)


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """(free, total) bytes the engine may use: a cuda device's now, the host memory this
    process may use on the CPU; None elsewhere (a pool of max_num_seqs sequences)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    return host_memory() if device.type == "cpu" else None


def _one_line(exc: Exception) -> str:
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
