"""What leaves an engine: finished requests, request snapshots, step work and load statistics.

All four are plain picklable dataclasses (lists, ints, floats, one CPU tensor), cheap to
send through Ray's object store. A snapshot's KV covers its first `num_computed` tokens in
the layout `[2 (k, v), num_layers, num_kv_heads, num_computed, head_dim]` on the CPU; the
random stream of the request is (seed, len(output_ids)), so no generator state is needed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dorarl.engine.config import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass
class RequestOutput:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]  # version of the weights that sampled each output token
    finish_reason: str  # "stop" | "length"
    migrations: int = 0
    offloads: int = 0
    reprefill_tokens: int = 0  # tokens whose KV was computed again (preemption, resume)


@dataclass
class RequestSnapshot:
    """A request's whole execution state, to continue it on another engine."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    params: SamplingParams
    seed: int
    version: int  # the weights version that computed `kv`
    num_computed: int = 0
    kv: torch.Tensor | None = None
    migrations: int = 0
    offloads: int = 0
    reprefill_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)  # resolved stop ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def kv_bytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()

    def tokens_only(self) -> RequestSnapshot:
        """The same request without its KV: continuing it re-prefills (any version)."""
        return dataclasses.replace(self, num_computed=0, kv=None)


@dataclass(frozen=True)
class StepWork:
    """What one engine step computed: the work a device cost model (or a pacer) charges for."""

    rows: int = 0  # sequences in the step's batch (busy slots)
    decode_tokens: int = 0  # rows that decoded one token
    prefill_tokens: int = 0  # prompt (or re-prefill) tokens computed in chunks
    resident_tokens: int = 0  # tokens with KV in the device pool after the step

    @property
    def extra_tokens(self) -> int:
        """Tokens beyond one per row: what the step costs over a plain decode step."""
        return self.decode_tokens + self.prefill_tokens - self.rows


@dataclass
class EngineStats:
    version: int
    running: int
    waiting: int  # queued with no KV on this engine's host pool (fresh, preempted, imported)
    offloaded: int  # queued with KV in the host pool
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_total: int
    host_blocks_used: int
    host_blocks_total: int
    max_num_seqs: int
    tokens_generated: int  # output tokens sampled since the engine started
    steps: int
    offloads: int  # KV moves device -> host, total
    restores: int  # KV moves host -> device, total
    preemptions: int  # KV dropped for recompute, total
    migrations_in: int
    migrations_out: int

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def free_slots(self) -> int:
        return max(0, self.max_num_seqs - self.running)
