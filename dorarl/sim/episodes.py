"""Multi-turn episodes in the simulator: a request's response cut into turns, each followed
by an environment call of seeded, random latency.

A pure function of (seed, group, sample): where each turn ends (generated-token counts,
every turn at least one token) and how long the environment takes after each, the last
turn included (it judges the episode's final answer before the episode ends).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from dorarl.config import ConfigError


@dataclass(frozen=True)
class EpisodeModel:
    max_turns: int = 4
    """Turns of an episode: uniform in 1..max_turns (no more than its tokens)."""
    latency_s: float = 0.1
    """Mean environment latency after a turn; each is exponential around it (a long tail)."""

    def validate(self) -> None:
        if self.max_turns < 1:
            raise ConfigError(f"max_turns: must be >= 1, got {self.max_turns}")
        if not 0 <= self.latency_s < float("inf"):
            raise ConfigError(f"latency_s: must be finite and >= 0, got {self.latency_s}")

    def turn_ends(self, seed: int, group_id: int, sample_index: int, length: int) -> list[int]:
        """Generated-token counts at which a turn ends before the last (which ends at `length`)."""
        rng = random.Random(f"sim/turns/{seed}/{group_id}/{sample_index}")
        turns = min(rng.randint(1, self.max_turns), max(1, length))
        return sorted(rng.sample(range(1, length), turns - 1)) if turns > 1 else []

    def latency(self, seed: int, group_id: int, sample_index: int, turn: int) -> float:
        """Seconds the environment takes after turn `turn` (counted from 1)."""
        if self.latency_s == 0:
            return 0.0
        rng = random.Random(f"sim/env/{seed}/{group_id}/{sample_index}/{turn}")
        return rng.expovariate(1.0 / self.latency_s)
