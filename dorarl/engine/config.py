"""Engine and per-request sampling configuration, validated on construction.

`EngineConfig` errors are `ConfigError`s naming the `engine.<field>` key (simple bounds are
declared on its fields: dorarl.config.fields); `SamplingParams`
errors are `UserInputError`s naming the request, because they arrive with a request.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, field
from typing import Literal

from dorarl.config import ConfigError, check_fields
from dorarl.engine.capabilities import DORARL_CAPABILITIES, Capabilities
from dorarl.engine.token_ids import checked_token_ids
from dorarl.engine.vllm.config import (
    ROUTES_NEED_EAGER,
    ROUTES_ON_CUDA,
    VLLM_CAPABILITIES,
    VllmArgs,
    vllm_missing,
)
from dorarl.errors import UserInputError

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
LinearKernel = Literal["auto", "onednn", "torch"]  # dorarl/engine/linear.py
# The GPU fast paths (dorarl/engine/backends.py resolves `auto` for the device).
Attention = Literal["auto", "triton", "torch", "cpp"]
Sampler = Literal["auto", "device", "host"]
# YAML 1.1 reads a bare on / off as true / false: both spellings are taken, stored as on / off.
CudaGraphs = Literal["auto", "on", "off", True, False]
PrefixCacheMode = Literal["on", "off"]
Backend = Literal["dorarl", "vllm"]
TRITON_MIN = 16  # the Triton kernels' smallest block size and head dim (triton_attention.py)
# Keys per Triton decode partition; fixed so a row's result never depends on its batch.
DECODE_PARTITION_TOKENS = 512
ADAPTED_PROJECTIONS = frozenset(
    ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
)
"""The HF projections a resident LoRA adapter may target (lora.py; an MoE layer's experts
keep none)."""


def triton_unfit(block_size: int, head_dim: int | None = None) -> str | None:
    """What the Triton kernels cannot run, e.g. "block_size 24" (their tiles are powers of
    two of at least 16), or None; the head dim is known once the model is."""
    for name, value in (("block_size", block_size), ("head_dim", head_dim)):
        if value is not None and not _power_of_two_from(value, TRITON_MIN):
            return f"{name} {value}"
    return None


def _power_of_two_from(value: int, least: int) -> bool:
    return value >= least and value & (value - 1) == 0


@dataclass(kw_only=True)
class EngineConfig:
    """Capacity and placement of one rollout engine (one instance)."""

    backend: Backend = field(
        default="dorarl",
        metadata={
            "help": "dorarl (this engine) | vllm (one vLLM engine per instance, its own "
            "arguments under engine.vllm; dorarl.engine.vllm)"
        },
    )
    vllm: VllmArgs = field(default_factory=VllmArgs)
    max_num_seqs: int = field(
        default=64, metadata={"help": "slot budget: max running sequences", "gt": 0}
    )
    block_size: int = field(default=16, metadata={"help": "tokens per KV block", "gt": 0})
    num_blocks: int | None = field(
        default=None,
        metadata={
            "help": "KV blocks on the device; None: max_num_seqs full-length sequences, at "
            "most what the engine's memory share leaves after weights and workspace (cuda: "
            "engine.gpu_memory_share; cpu: a quarter of the host memory it may use)",
            "gt": 0,
        },
    )
    max_model_len: int = field(
        default=2048, metadata={"help": "max prompt + output tokens", "gt": 0}
    )
    prefill_chunk_size: int = field(
        default=512,
        metadata={"help": "max prefill tokens per step (long prompts prefill in chunks)", "gt": 0},
    )
    host_blocks: int = field(
        default=0,
        metadata={"help": "host-memory KV blocks for offload; 0: recompute instead", "ge": 0},
    )
    offload_threshold: float = field(
        default=0.95,
        metadata={
            "help": "offload running requests above this share of used blocks",
            "gt": 0,
            "le": 1,
        },
    )
    device: str = field(default="cpu", metadata={"help": "torch device, e.g. cpu or cuda:0"})
    gpu_memory_share: float | None = field(
        default=None,
        metadata={
            "help": "on cuda, the share of the GPU's memory for this engine's weights, "
            "workspace and KV pool (None: its GPU share in Ray, else 0.9)",
            "gt": 0,
            "le": 1,
        },
    )
    dtype: Dtype = field(
        default="auto",
        metadata={"help": "auto (bfloat16 on cuda, float32 on cpu) | float32 | bfloat16 | float16"},
    )
    attention: Attention = field(
        default="auto",
        metadata={
            "help": "auto (triton on cuda; on cpu in float32 cpp where it builds, else torch) | "
            "triton (paged Triton kernels; on cpu only in Triton's interpreter, "
            "TRITON_INTERPRET=1) | torch (attention.py) | cpp (cpu float32: decode attention, "
            "RMSNorm and RoPE on fused C++ kernels, compiled once and cached, cpu_kernels.py; "
            "prefill attention on torch)"
        },
    )
    sampler: Sampler = field(
        default="auto",
        metadata={
            "help": "auto (device on cuda, host on cpu) | device (batched tensor ops, one host "
            "sync) | host (sampler.py); the same streams either way"
        },
    )
    cuda_graphs: CudaGraphs = field(
        default="auto",
        metadata={
            "help": "auto (on where the device is cuda and attention is triton) | on | off: "
            "decode steps replay CUDA graphs captured per batch bucket at start"
        },
    )
    linear_kernel: LinearKernel = field(
        default="auto",
        metadata={
            "help": "matmul kernel: auto (oneDNN prepacked on CPU float32 where it runs, else "
            "F.linear) | onednn | torch (F.linear)"
        },
    )
    prefix_cache: PrefixCacheMode = field(
        default="on",
        metadata={
            "help": "on | off: requests of the hosted version read the KV blocks of prompt "
            "tokens another request computed (a group's samples prefill their prompt once; "
            "block_manager.py)"
        },
    )
    seed: int = field(default=0, metadata={"help": "draws seeds for requests that bring none"})
    record_routes: bool = field(
        default=False,
        metadata={
            "help": "MoE models: record each sampled token's expert ids per sparse layer "
            "(top_k bytes a layer, with the sample), which the trainer checks against its own "
            "routing and replays with trainer.moe.route_replay"
        },
    )

    max_versions: int = field(
        default=1,
        metadata={
            "help": "policy versions one instance serves at once: the full-weight version plus "
            "up to max_versions - 1 LoRA adapters over it (Engine.load_adapter), whose "
            "requests decode together in one step (lora.py); 1: the full-weight version only",
            "gt": 0,
        },
    )
    max_lora_rank: int = field(
        default=64,
        metadata={
            "help": "the largest adapter rank engine.max_versions > 1 holds (smaller ranks are "
            "zero-padded to it: each adapter slot takes this rank's memory)",
            "gt": 0,
        },
    )

    def __post_init__(self) -> None:
        self.validate()

    @property
    def capabilities(self) -> Capabilities:
        """What the backend's engines can do beyond the calls every backend answers."""
        return VLLM_CAPABILITIES if self.backend == "vllm" else DORARL_CAPABILITIES

    @property
    def kv_blocks(self) -> int:
        """KV blocks on the device: `num_blocks`, or room for max_num_seqs full-length
        sequences when unset (derived, not stored, so it follows the keys it comes from); on
        cuda an unset pool is at most this, what its memory share holds (memory.py)."""
        if self.num_blocks is not None:
            return self.num_blocks
        return self.max_num_seqs * math.ceil(self.max_model_len / self.block_size)

    def validate(self) -> None:
        check_fields(self, "engine.")  # bounds and choices first: kv_blocks divides by block_size
        if self.backend == "vllm":
            self._check_vllm()
        self._check_fast_paths()
        self._check_versions()
        # Liveness: one request of max_model_len tokens must fit alone, or it could never run.
        if self.kv_blocks * self.block_size < self.max_model_len:
            raise ConfigError(
                f"engine.num_blocks: {self.kv_blocks} blocks of {self.block_size} tokens cannot hold "
                f"one request of engine.max_model_len={self.max_model_len} tokens"
            )

    def _check_vllm(self) -> None:
        """What backend vllm needs installed, and the keys it cannot serve (its
        capabilities), refused up front."""
        missing = vllm_missing()
        if missing:
            raise ConfigError(f"engine.backend: vllm {missing}")
        can = VLLM_CAPABILITIES
        for key, needs, able in (
            ("host_blocks", self.host_blocks > 0, can.offload),
            ("max_versions", self.max_versions > 1, can.adapters),
            ("record_routes", self.record_routes, can.route_recording),
        ):
            if needs and not able:
                raise ConfigError(
                    f"engine.{key}: {getattr(self, key)} is not served by engine.backend=vllm "
                    "(use engine.backend=dorarl)"
                )
        if self.record_routes and self.device.startswith("cuda"):
            raise ConfigError(
                f"engine.record_routes: true {ROUTES_ON_CUDA} (use engine.backend=dorarl)"
            )
        if self.record_routes and not self.vllm.enforce_eager:
            raise ConfigError(f"engine.record_routes: true {ROUTES_NEED_EAGER}")

    def _check_versions(self) -> None:
        """What several resident versions cannot share yet on this engine, refused up front
        (vLLM keys its prefix cache by LoRA and by each version's cache_salt)."""
        if self.max_versions == 1 or self.backend == "vllm":
            return
        if self.prefix_cache == "on":
            # The prefix cache keys blocks by the full-weight version only: an adapter's
            # request would read KV the base computed.
            raise ConfigError(
                f"engine.max_versions: {self.max_versions} needs engine.prefix_cache=off (cached "
                "blocks are keyed by the full-weight version, not by adapter)"
            )
        if self.cuda_graphs == "on":
            raise ConfigError(
                f"engine.max_versions: {self.max_versions} needs engine.cuda_graphs=off or auto "
                "(the captured decode step has no per-row adapters)"
            )

    def _check_fast_paths(self) -> None:
        """The fast-path choices that cannot work on this device, refused up front."""
        if isinstance(self.cuda_graphs, bool):
            self.cuda_graphs = "on" if self.cuda_graphs else "off"
        if isinstance(self.prefix_cache, bool):
            self.prefix_cache = "on" if self.prefix_cache else "off"
        on_cuda = self.device.startswith("cuda")
        if self.attention == "triton" and importlib.util.find_spec("triton") is None:
            raise ConfigError("engine.attention: triton is not installed (pip install -e '.[gpu]')")
        if self.attention == "triton" and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError(
                f"engine.attention: triton needs engine.device=cuda (got {self.device!r}) or "
                "Triton's interpreter on the CPU (TRITON_INTERPRET=1, slow: for tests)"
            )
        if self.attention == "cpp" and (on_cuda or self.dtype not in ("auto", "float32")):
            raise ConfigError(
                f"engine.attention: cpp runs on cpu in float32 only (got engine.device="
                f"{self.device!r}, engine.dtype={self.dtype!r})"
            )
        unfit = triton_unfit(self.block_size)
        if unfit and (self.attention == "triton" or self.cuda_graphs == "on"):
            asked = "attention=triton" if self.attention == "triton" else "cuda_graphs=on"
            raise ConfigError(
                f"engine.block_size: engine.{asked} needs a power of two >= {TRITON_MIN} "
                f"(the Triton kernels' tiles), got {self.block_size}; engine.attention=torch "
                "runs any block size"
            )
        if self.cuda_graphs == "on" and not on_cuda:
            raise ConfigError(
                f"engine.cuda_graphs: on needs engine.device=cuda, got {self.device!r}"
            )
        if self.cuda_graphs == "on" and self.attention == "torch":
            raise ConfigError(
                "engine.cuda_graphs: on needs engine.attention=triton or auto (the graphs "
                "capture the Triton decode step)"
            )


@dataclass
class SamplingParams:
    """How one request samples. temperature 0 is greedy; top_k 0 and top_p 1 disable filtering.

    stop_token_ids None means the model's EOS ids; [] means no stop ids. stop_strings end a
    turn at the first token whose text completes one (finish reason "stop_string"; the engine
    needs the model's tokenizer for them). target_len forces the response length (benchmarks):
    stop ids and strings are ignored and the request stops at exactly target_len tokens,
    overriding max_new_tokens.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    stop_token_ids: list[int] | None = None
    stop_strings: list[str] = field(default_factory=list)
    seed: int | None = None
    target_len: int | None = None
    multi_turn: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0

    def validate(self, request_id: str) -> None:
        where = f"request {request_id!r}: sampling"
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise UserInputError(f"{where}.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise UserInputError(f"{where}.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UserInputError(f"{where}.top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens <= 0:
            raise UserInputError(f"{where}.max_new_tokens must be > 0, got {self.max_new_tokens}")
        if self.target_len is not None and self.target_len <= 0:
            raise UserInputError(f"{where}.target_len must be > 0, got {self.target_len}")
        if self.stop_token_ids is not None:
            checked_token_ids(request_id, self.stop_token_ids, "sampling.stop_token_ids")
        bad = [s for s in self.stop_strings if not isinstance(s, str) or not s]
        if bad or isinstance(self.stop_strings, str):
            raise UserInputError(
                f"{where}.stop_strings must be a list of non-empty strings, got {self.stop_strings!r}"
            )
