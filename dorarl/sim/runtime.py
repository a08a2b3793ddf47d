"""Simulation runtime: the driver and the real controller on cost-model instances and trainer.

A virtual clock drives the very same `Controller` the Ray runtime drives, through the same
`Driver`, and the shared `Recorder` writes the same files. The machinery is `SimCluster`,
a strict executor (it raises `ProtocolError` on any command a real runtime could not
honour); a run whose queue holds nothing but timers raises `Deadlock`, and so does one
that handles `watchdog_events` events without a training step. Deterministic for a seed.
Token ids are placeholders (the cost model has no vocabulary): samples carry O(1)
sequences of the right length and per-token versions; rewards come from a `RewardModel`
(a seeded share of uniform groups, for dynamic sampling). With `episodes` every request is
a multi-turn episode whose environment takes a seeded latency after each turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dorarl.config import ConfigError
from dorarl.controller import (
    Command,
    Controller,
    ControllerConfig,
    Event,
    ProtocolError,
    TrainDone,
    parse_request_id,
)
from dorarl.data.lengths import LengthDist
from dorarl.driver import Driver, Executor, Observer
from dorarl.record import Recorder
from dorarl.sim.cluster import SimCluster
from dorarl.sim.cost import CostModel
from dorarl.sim.episodes import EpisodeModel
from dorarl.sim.rewards import RewardModel

__all__ = ["Deadlock", "ProtocolError", "RunResult", "SimRuntime"]


class Deadlock(RuntimeError):
    """Nothing left to happen but timers, and the run is not finished."""


@dataclass
class RunResult:
    summary: dict[str, Any]
    steps: list[dict[str, Any]]
    out_dir: Path | None
    controller: Controller
    events: int


class SimRuntime:
    cluster: SimCluster  # made by the driver's `executor` (it answers to the driver)

    def __init__(
        self,
        config: ControllerConfig,
        cost: CostModel | None = None,
        lengths: LengthDist | None = None,
        seed: int = 0,
        out_dir: str | Path | None = None,
        *,
        observer: Observer | None = None,
        trace: bool = True,
        trajectories: bool = True,
        watchdog_events: int = 5_000_000,
        rewards: RewardModel | None = None,
        episodes: EpisodeModel | None = None,
    ) -> None:
        cost, lengths = cost or CostModel(), lengths or LengthDist()
        rewards = rewards or RewardModel()
        _validate(config, cost, lengths)
        rewards.validate()
        if episodes is not None:
            episodes.validate()
        self.recorder = _recorder(config, out_dir, trace=trace, trajectories=trajectories)
        self.watchdog = _Watchdog(watchdog_events, lambda: self.cluster.now)
        observers = [self.watchdog] + ([observer] if observer is not None else [])

        def machinery(driver: Driver) -> Executor:
            """The cluster, made with the driver it answers to: the driver's executor."""
            self.cluster = SimCluster(
                config, cost, lengths.prompt_len, self.recorder, driver,
                rewards=rewards, seed=seed, episodes=episodes,
            )  # fmt: skip
            return Executor(self.cluster, self.cluster.train, self.cluster.set_timer)

        self.driver = Driver(
            config,
            self.recorder,
            machinery,
            lambda: self.cluster.now,
            lengths=lengths,
            seed=seed,
            observers=observers,
        )

    @property
    def controller(self) -> Controller:
        return self.driver.controller

    def run(self) -> RunResult:
        self.driver.run(self._poll)
        self._report_lost()
        summary = self.recorder.close(self.cluster.now)
        return RunResult(
            summary,
            self.recorder.steps,
            self.recorder.out_dir,
            self.controller,
            self.watchdog.events,
        )

    def _poll(self) -> None:
        if not self.cluster.pending:
            now = self.cluster.now
            raise Deadlock(f"only timers left at t={now:.3f}s: {self.controller.counts()}")
        self.cluster.poll()

    def _report_lost(self) -> None:
        """Every request the controller believes in flight must exist somewhere here."""
        known = self.cluster.known_requests()
        for rid in self.controller.requests_in_flight():
            if rid not in known:
                self.recorder.lost(parse_request_id(rid)[0], "request_lost_by_runtime")


class _Watchdog:
    """Observer: counts events and raises `Deadlock` after `limit` without a training step
    (a livelock: events keep coming, the run never gets closer to its end)."""

    def __init__(self, limit: int, now) -> None:
        self.limit, self.now = limit, now
        self.events = 0
        self.since_step = 0

    def __call__(self, controller: Controller, event: Event, commands: list[Command]) -> None:
        self.events += 1
        self.since_step = 0 if isinstance(event, TrainDone) else self.since_step + 1
        if self.since_step > self.limit:
            raise Deadlock(
                f"{self.since_step} events without a training step (livelock?) at t={self.now():.3f}s"
            )


def _validate(config: ControllerConfig, cost: CostModel, lengths: LengthDist) -> None:
    config.validate()
    cost.validate()
    lengths.validate()
    longest = lengths.prompt_len + lengths.max_len
    if longest > cost.kv_capacity_tokens:
        raise ConfigError(
            f"kv_capacity_tokens: {cost.kv_capacity_tokens} cannot hold one request of {longest} tokens"
        )


def _recorder(
    config: ControllerConfig, out_dir: str | Path | None, *, trace: bool, trajectories: bool
) -> Recorder:
    """The simulated run's recorder, shaped by its controller config."""
    return Recorder(
        out_dir,
        mode=config.mode,
        k=config.effective_K,
        num_instances=config.instances,
        slots_per_instance=config.slots,
        trajectories=trajectories,
        trace=trace,
        first_version=config.initial_version,
        versions_per_instance=config.versions_per_instance,
    )
