"""The learning-rate schedule: linear warmup, then constant, linear or cosine decay to a floor,
as a closed-form function of the optimizer step (so a resumed trainer continues it exactly)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LrSchedule:
    """`peak` after `warmup` steps; `kind` decays it to `floor` x peak at `decay_steps`
    (counted from step 0, warmup included) and holds it there."""

    peak: float
    kind: str = "constant"
    warmup: int = 0
    decay_steps: int | None = None
    floor: float = 0.0

    def at(self, step: int) -> float:
        """The rate of the update made after `step` earlier updates (0-based)."""
        return self.peak * self.scale(step)

    def scale(self, step: int) -> float:
        if self.warmup and step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == "constant" or self.decay_steps is None:
            return 1.0
        span = max(1, self.decay_steps - self.warmup)
        done = min(1.0, max(0.0, (step - self.warmup) / span))
        if self.kind == "linear":
            return self.floor + (1.0 - self.floor) * (1.0 - done)
        return self.floor + (1.0 - self.floor) * 0.5 * (1.0 + math.cos(math.pi * done))
