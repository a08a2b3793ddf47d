"""What vLLM's scheduler reports each step (running and waiting requests, KV use, prefix
cache queries and hits), caught by a stat logger of ours for `EngineStats`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase


@dataclass
class SchedulerView:
    """The latest step's scheduler figures and the prefix cache's sums."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # share of the KV blocks in use
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache, total
    prefix_hits: int = 0  # of which found, total

    def take(self, stats: Any) -> None:
        """One step's `SchedulerStats`."""
        self.running, self.waiting = stats.num_running_reqs, stats.num_waiting_reqs
        self.kv_usage = stats.kv_cache_usage
        cache = stats.prefix_cache_stats
        self.step_hits = cache.hits
        self.prefix_queries += cache.queries
        self.prefix_hits += cache.hits
        details = stats.iteration_details
        if details is not None:
            self.step_prefill, self.step_decode = (
                details.num_ctx_tokens,
                details.num_generation_requests,
            )
            self.prefill_tokens += details.num_ctx_tokens


def logger_factory(view: SchedulerView):
    """A per-engine stat logger factory for `LLMEngine` that feeds `view`."""

    class _Logger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            del vllm_config, engine_index

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            if scheduler_stats is not None:
                view.take(scheduler_stats)

        def log_engine_initialized(self) -> None:
            pass

    return _Logger
