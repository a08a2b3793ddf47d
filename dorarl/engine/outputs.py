"""What leaves an engine: finished requests, request snapshots, step work, load statistics
and how it set itself up.

All are plain picklable dataclasses (lists, ints, floats, one CPU tensor), cheap to
send through Ray's object store. A snapshot's KV covers its first `num_computed` tokens in
the layout `[2 (k, v), num_layers, num_kv_heads, num_computed, head_dim]` on the CPU; the
random stream of the request is (seed, len(output_ids)), so no generator state is needed.
A request of several segments (`Engine.start_segment`) shows them all in its output, flat:
the first segment's prompt, then every segment's tokens with each later prompt observed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dorarl.data.samples import SegmentStart
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
    finish_reason: str  # "stop" (a stop token) | "stop_string" | "length"
    migrations: int = 0
    offloads: int = 0
    reprefill_tokens: int = 0  # tokens whose KV was computed again (preemption, resume)
    observed: list[bool] = field(default_factory=list)  # per output token: an env's, not sampled
    turn_start: int = 0  # output index where the last turn's sampled tokens begin
    waits_env: bool = False  # multi-turn: a turn ended; continue_request or end_request next
    stop_string: str | None = None  # the stop string that ended the (last) turn
    routes: bytes = b""  # MoE, engine.record_routes: each output token's experts (data/routes.py)
    segments: list[SegmentStart] = field(default_factory=list)  # where later segments begin

    @property
    def turn_ids(self) -> list[int]:
        """The last turn's sampled tokens."""
        return self.output_ids[self.turn_start :]

    @property
    def context_tokens(self) -> int:
        """Tokens of the current segment (its prompt and output): what max_model_len bounds."""
        if self.segments:
            return len(self.output_ids) - self.segments[-1].at
        return len(self.prompt_ids) + len(self.output_ids)


@dataclass
class EarlierSegments:
    """A request's segments before its current one, as its output shows them: the first
    segment's prompt, then every earlier segment's output, each followed by the next
    segment's prompt as observed tokens (the current one's last), and where each begins."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    observed: list[bool]
    routes: bytes
    starts: list[SegmentStart]


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
    observed: list[bool] = field(default_factory=list)
    turn_start: int = 0
    waits_env: bool = False  # a multi-turn request between turns (KV kept, no slot)
    turn_reason: str | None = None  # how its last turn ended, while it waits
    # a weight load came while it held KV, so `kv` mixes versions: continued, never shared
    kv_mixed: bool = False
    turn_stop_string: str | None = None  # and the stop string that ended it, if one did
    routes: bytes = b""  # the output tokens' recorded experts (data/routes.py), if any
    earlier: EarlierSegments | None = None  # segments before the current one (its tokens above)

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
    saved_tokens: int = 0  # prompt tokens whose KV the prefix cache gave (not computed)
    versions: int = 1  # policy versions among its rows (the full weights' and adapters')

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
    env_waiting: int  # multi-turn requests between turns: KV held, no slot
    kv_blocks_used: int  # held by requests (idle cached blocks are free: taken on demand)
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
    kv_blocks_cached: int = 0  # blocks the prefix cache keys, held or idle
    prefill_tokens: int = 0  # prompt tokens computed, total
    prefill_saved_tokens: int = 0  # prompt tokens the prefix cache gave instead, total
    multi_version_steps: int = 0  # steps whose rows ran under two or more versions, total

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """Share of the prompt tokens placed so far whose KV came from the prefix cache."""
        return prefix_hit_rate(self.prefill_tokens, self.prefill_saved_tokens)

    @property
    def free_slots(self) -> int:
        return max(0, self.max_num_seqs - self.running)


def prefix_hit_rate(computed: int, saved: int) -> float:
    """Saved over all prompt tokens placed (computed ones count re-prefills too)."""
    return saved / (computed + saved) if computed + saved else 0.0


@dataclass(frozen=True)
class FastPathFallback:
    """A fast path the engine chose (`auto`) that failed its start-up check on the device."""

    path: str  # the engine key: attention | cuda_graphs
    instead: str  # what runs in its place: torch | off
    error: str  # the failure, one line


@dataclass
class EngineSetup:
    """What an engine runs, as it resolved its keys and checked its fast paths at start."""

    attention: str  # triton | torch | cpp
    sampler: str  # device | host
    cuda_graphs: bool
    dtype: str
    kv_blocks: int  # blocks the block manager hands out
    block_size: int
    kv_budget: str | None = None  # on cuda: how the pool was sized (memory.KVPlan.describe)
    peak_bytes: int | None = None  # on cuda: torch's peak allocation by the end of start-up
    fast_path_fallbacks: list[FastPathFallback] = field(default_factory=list)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def with_earlier(out: RequestOutput, e: EarlierSegments) -> RequestOutput:
    """A later segment's output preceded by the segments before it, as one flat response."""
    return dataclasses.replace(
        out,
        prompt_ids=list(e.prompt_ids),
        output_ids=e.output_ids + out.output_ids,
        logprobs=e.logprobs + out.logprobs,
        versions=e.versions + out.versions,
        observed=e.observed + out.observed,
        turn_start=len(e.output_ids) + out.turn_start,
        routes=e.routes + out.routes,
        segments=list(e.starts),
    )
