"""What an engine reports (mixed into `Engine`): what it runs and how its pool was sized
(`setup`), and its figures now, counters included (`stats`)."""

from __future__ import annotations

import torch

from dorarl.engine.backends import Backends
from dorarl.engine.block_manager import BlockManager
from dorarl.engine.config import EngineConfig
from dorarl.engine.memory import KVPlan
from dorarl.engine.outputs import EngineSetup, EngineStats, FastPathFallback
from dorarl.engine.scheduler import Scheduler
from dorarl.engine.sequence import KVPlace

COUNTERS = (
    "tokens",
    "steps",
    "offloads",
    "restores",
    "preemptions",
    "migrations_in",
    "migrations_out",
    "prefill_tokens",
    "prefill_saved_tokens",
    "multi_version_steps",
)
"""What `_counters` counts, each from the engine's start."""


class Reports:
    """The engine's setup and stats, read from its parts and its `_counters`."""

    config: EngineConfig
    device: torch.device
    version: int
    backends: Backends
    kv_plan: KVPlan | None
    kv_blocks: int
    fallbacks: list[FastPathFallback]
    blocks: BlockManager
    scheduler: Scheduler
    _counters: dict[str, int]

    def setup(self) -> EngineSetup:
        """What this engine runs and how its pool was sized (reported at start)."""
        b = self.backends
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        return EngineSetup(
            attention=b.attention,
            sampler=b.sampler,
            cuda_graphs=b.cuda_graphs,
            dtype=str(b.dtype).removeprefix("torch."),
            kv_blocks=self.kv_blocks,
            block_size=self.config.block_size,
            kv_budget=None if self.kv_plan is None else self.kv_plan.describe(),
            peak_bytes=peak,
            fast_path_fallbacks=list(self.fallbacks),
        )

    def stats(self) -> EngineStats:
        waiting = self.scheduler.waiting()
        offloaded = sum(seq.kv_place is KVPlace.HOST for seq in waiting)
        c = self._counters
        return EngineStats(
            version=self.version,
            running=len(self.scheduler.running),
            waiting=len(waiting) - offloaded,
            offloaded=offloaded,
            env_waiting=len(self.scheduler.parked),
            kv_blocks_used=self.blocks.device.num_used,
            kv_blocks_free=self.blocks.device.num_free,
            kv_blocks_total=self.blocks.device.num_total,
            kv_blocks_cached=self.blocks.device.num_cached,
            host_blocks_used=self.blocks.host.num_used,
            host_blocks_total=self.blocks.host.num_total,
            max_num_seqs=self.config.max_num_seqs,
            tokens_generated=c["tokens"],
            steps=c["steps"],
            offloads=c["offloads"],
            restores=c["restores"],
            preemptions=c["preemptions"],
            migrations_in=c["migrations_in"],
            migrations_out=c["migrations_out"],
            prefill_tokens=c["prefill_tokens"],
            prefill_saved_tokens=c["prefill_saved_tokens"],
            multi_version_steps=c["multi_version_steps"],
        )
