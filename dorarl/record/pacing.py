"""Device emulation by pacing: each engine step and training step lasts at least its device time.

On a shared CPU, N instances are not N accelerators: an idle instance's time goes to the
busy ones. A paced worker computes for real, then sleeps until the device time of that work
has elapsed since the work began, so wall time follows the device model. Invariant: a paced
call never returns before its device time; a step whose real compute exceeded it is counted
(`over`) and keeps its real duration, never hidden.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from dorarl.config import ConfigError


@dataclass(kw_only=True)
class DeviceModel:
    """Device time of the work a worker does; `from_dict(to_dict())` round-trips."""

    decode_step_s: float = field(
        metadata={"help": "one engine step: weights read once, about constant in batch size"}
    )
    kv_token_s: float = field(default=0.0, metadata={"help": "per resident KV token per step"})
    prefill_token_s: float = field(
        default=0.0, metadata={"help": "per prefilled token beyond one per row (compute-bound)"}
    )
    train_fixed_s: float = field(default=0.0, metadata={"help": "per training step"})
    train_token_s: float = field(
        default=0.0, metadata={"help": "per trained token (prompt + response)"}
    )

    def validate(self) -> None:
        for key, value in asdict(self).items():
            if not value >= 0:
                raise ConfigError(f"pace.{key}: must be >= 0, got {value}")
        if self.decode_step_s <= 0:
            raise ConfigError(f"pace.decode_step_s: must be > 0, got {self.decode_step_s}")

    def engine_step_s(self, prefill_tokens: int, resident_tokens: int) -> float:
        return (
            self.decode_step_s
            + self.prefill_token_s * prefill_tokens
            + self.kv_token_s * resident_tokens
        )

    def train_step_s(self, tokens: int) -> float:
        return self.train_fixed_s + self.train_token_s * tokens

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, float]) -> DeviceModel:
        return cls(**values)


@dataclass
class PaceStats:
    """Real compute against device time over a number of paced steps."""

    steps: int = 0
    over: int = 0  # steps whose real compute exceeded their device time
    compute_s: float = 0.0
    paced_s: float = 0.0
    excess_s: float = 0.0  # real time beyond the pace, summed over the steps over it
    worst_ratio: float = 0.0  # max over steps of real compute / device time

    def record(self, compute_s: float, paced_s: float) -> None:
        self.steps += 1
        self.compute_s += compute_s
        self.paced_s += paced_s
        if compute_s > paced_s:
            self.over += 1
            self.excess_s += compute_s - paced_s
        if paced_s > 0:
            self.worst_ratio = max(self.worst_ratio, compute_s / paced_s)

    def merge(self, other: PaceStats) -> None:
        self.steps += other.steps
        self.over += other.over
        self.compute_s += other.compute_s
        self.paced_s += other.paced_s
        self.excess_s += other.excess_s
        self.worst_ratio = max(self.worst_ratio, other.worst_ratio)

    @property
    def over_share(self) -> float:
        return self.over / self.steps if self.steps else 0.0

    def to_dict(self) -> dict[str, float]:
        return asdict(self) | {"over_share": self.over_share}


class Pacer:
    """Holds a worker to its device time: `finish(started, device_s)` after each unit of work."""

    def __init__(self) -> None:
        self.stats = PaceStats()

    def finish(self, started: float, device_s: float) -> float:
        """Sleep until `device_s` after `started` (a `time.perf_counter()` reading); returns
        the real compute time, which is recorded against the pace."""
        compute = time.perf_counter() - started
        self.stats.record(compute, device_s)
        deadline = started + device_s
        while (left := deadline - time.perf_counter()) > 0:
            time.sleep(left)
        return compute

    def take(self) -> PaceStats:
        """The stats since the last `take` (a report carries them to the runtime)."""
        stats, self.stats = self.stats, PaceStats()
        return stats


class PaceTally:
    """Paced work a run reported, engines and trainer apart: since the last training step
    (each step's `pace_engine` / `pace_train` metrics) and over the whole run."""

    KINDS = ("engine", "train")

    def __init__(self) -> None:
        self.step = {kind: PaceStats() for kind in self.KINDS}
        self.total = {kind: PaceStats() for kind in self.KINDS}

    def add(self, kind: str, stats: PaceStats) -> None:
        self.step[kind].merge(stats)
        self.total[kind].merge(stats)

    @property
    def paced(self) -> bool:
        """Whether any paced work was reported (an unpaced run reports none)."""
        return any(stats.steps for stats in self.total.values())

    def take_step(self) -> dict[str, dict[str, float]]:
        """The step's metrics (`pace_engine`, `pace_train`), starting the next step's tally."""
        fields = {f"pace_{kind}": stats.to_dict() for kind, stats in self.step.items()}
        self.step = {kind: PaceStats() for kind in self.KINDS}
        return fields

    def totals(self) -> dict[str, dict[str, float]]:
        return {kind: stats.to_dict() for kind, stats in self.total.items()}
