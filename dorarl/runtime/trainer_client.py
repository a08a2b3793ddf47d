"""The trainer actor as the Ray runtime's executor of Train, its answers and checkpoints.

A training step is one call returning the step's metrics and the new version as the
`WeightTransport` publishes it (which makes the call: `step`), so a version whose step
finished always has weights to load. Every call that changes the trainer's state goes
through `submit_train` or `submit_save` and, with trainer recovery on, into its log
(dorarl.runtime.trainer_log), so a new trainer can replay it. `on_publish` runs before
the controller hears of a new version (a checkpoint then has the right data position);
`on_step` after, with the step's metrics row and its groups.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from dorarl.controller import TrainDone
from dorarl.data import Group
from dorarl.driver import Driver
from dorarl.record.pacing import PaceStats, PaceTally
from dorarl.runtime.calls import CallTable, lives
from dorarl.runtime.rollout import RolloutPlan
from dorarl.runtime.trainer_log import SaveCall, TrainCall, TrainerLog
from dorarl.runtime.weights import WeightTransport

StepHook = Callable[[dict[str, Any], list[Group]], None]


class TrainerClient:
    def __init__(
        self,
        actor: Any,
        version: int,
        calls: CallTable,
        weights: WeightTransport,
        plan: RolloutPlan,
        pace: PaceTally,
        clock: Callable[[], float],
    ) -> None:
        self.actor = actor
        self.published = version  # newest version the trainer made
        self.calls, self.weights, self.plan, self.pace, self.now = calls, weights, plan, pace, clock
        self.log: TrainerLog | None = None  # set when trainer recovery is on
        self.on_publish: Callable[[int], None] | None = None
        self.on_step: StepHook | None = None
        self.driver: Driver | None = None  # set by the runtime: where answers go

    def start(self) -> None:
        """Wait for the actor, and serve its starting weights as the first version."""
        ray.get(self.actor.version.remote())
        self.weights.publish(self.published, self.weights.initial(self.actor))

    def replaced(self, actor: Any, version: int) -> None:
        """A new trainer actor restored at `version` (trainer recovery) takes over."""
        self.actor = actor
        self.weights.restart(actor, version)

    def alive(self) -> bool:
        """Whether the trainer's process lives (a busy one does)."""
        return lives(self.actor.version.remote())

    # ---- calls ---------------------------------------------------------------------------
    def train(self, version: int, groups: list[Group]) -> None:
        """Execute a Train (logged first, so a new trainer can make it again)."""
        if self.log is not None:
            self.log.record(TrainCall(version, groups))
        self.submit_train(version, groups)

    def submit_train(self, version: int, groups: list[Group], kind: str = "train") -> None:
        metrics, weights = self.weights.step(self.actor, groups)
        self.calls.submit(metrics, kind, (version, groups, weights), self.now())

    def save_checkpoint(
        self, folder: str | Path, position: dict[str, Any], keep: int
    ) -> ray.ObjectRef:
        """Queue a checkpoint of the published version with its data position `position`."""
        call = SaveCall(int(position["version"]), str(folder), position, keep)
        if self.log is not None:
            self.log.record(call)
        return self.submit_save(call)

    def submit_save(self, call: SaveCall) -> ray.ObjectRef:
        ref = self.actor.save_checkpoint.remote(call.folder, call.position, call.keep)
        self.calls.submit(ref, "save", (call,), self.now())
        return ref

    # ---- answers -------------------------------------------------------------------------
    def on_trained(self, metrics: dict[str, Any], call: Any) -> None:
        version, groups, weights = call.args
        self.published = version + 1
        self.weights.publish(self.published, weights)
        driver = self._driver
        driver.recorder.step_metrics(self._step_metrics(metrics))
        if self.on_publish is not None:  # before the controller can queue the next step
            self.on_publish(self.published)
        driver.train_done(TrainDone(self.published, self.now()))
        if self.on_step is not None:
            self.on_step(driver.recorder.steps[-1], groups)

    def _step_metrics(self, metrics: dict[str, Any]) -> dict[str, Any]:
        metrics = {k: v for k, v in metrics.items() if k != "version"}  # the recorder's own
        metrics["reward_errors"] = self.plan.reward_errors
        metrics["env_errors"] = self.plan.env_errors
        if "train_paced_s" in metrics:
            train = PaceStats()
            train.record(metrics["train_compute_s"], metrics["train_paced_s"])
            self.pace.add("train", train)
        if self.pace.paced:
            metrics |= self.pace.take_step()
        return metrics

    @property
    def _driver(self) -> Driver:
        assert self.driver is not None, "TrainerClient.driver is set by its runtime"
        return self.driver
