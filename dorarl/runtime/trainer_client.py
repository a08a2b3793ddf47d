"""The trainer actor as the Ray runtime's executor of Train, its answers and checkpoints.

A training step is one call returning the step's metrics and the new version as the
`WeightTransport` publishes it (which makes the call: `step`), so a version whose step
finished always has weights to load. Every call that changes the trainer's state goes
through `submit_step` or `submit_save` and, with trainer recovery on, into its `log`
(dorarl.runtime.recovery.trainer_log), so a new trainer can replay it; a completed checkpoint cuts
the log. `on_publish` runs before the controller hears of a new version (a checkpoint then
has the right data position); `on_step` after, with the step's metrics row and its groups.
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
from dorarl.runtime.calls import CallTable, CheckpointCall, ReplayCall, StepCall, lives
from dorarl.runtime.recovery.trainer_log import SaveCall, TrainCall, TrainerLog
from dorarl.runtime.rollout import RolloutPlan
from dorarl.runtime.transfer.weights import WeightTransport

StepHook = Callable[[dict[str, Any], list[Group]], None]
"""Called after each step's TrainDone with its metrics row and its groups."""

PublishHook = Callable[[int], None]
"""Called with each new version before the controller hears of it."""


class TrainerClient:
    """The trainer actor (`actor`: a replaced one is the new actor) and the newest version
    it made (`published`), the executor of the driver's Train."""

    def __init__(
        self,
        driver: Driver,
        actor: Any,
        calls: CallTable,
        weights: WeightTransport,
        plan: RolloutPlan,
        pace: PaceTally,
        *,
        log: TrainerLog | None = None,
        on_step: StepHook | None = None,
        on_publish: PublishHook | None = None,
    ) -> None:
        self.driver = driver  # where answers go; its clock is the runtime's
        self.actor = actor
        self.published = driver.config.initial_version  # newest version the trainer made
        self.calls, self.weights, self.plan, self.pace = calls, weights, plan, pace
        self.now = driver.now
        self.log = log  # with trainer recovery: what a new trainer replays
        self.on_step, self.on_publish = on_step, on_publish

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
        step = TrainCall(version, groups)
        if self.log is not None:
            self.log.record(step)
        self.submit_step(step)

    def submit_step(self, step: TrainCall, replay: bool = False) -> None:
        """Send `step` to the trainer; a `replay` makes again a step whose TrainDone was
        delivered already."""
        metrics, weights = self.weights.step(self.actor, step.groups)
        kind = ReplayCall if replay else StepCall
        self.calls.submit(kind(step, weights, ref=metrics, started=self.now()))

    def save_checkpoint(
        self, folder: str | Path, position: dict[str, Any], keep: int
    ) -> ray.ObjectRef:
        """Queue a checkpoint of the published version with its data position `position`."""
        call = SaveCall(int(position["version"]), str(folder), position, keep)
        if self.log is not None:
            self.log.record(call)
        return self.submit_save(call)

    def submit_save(self, save: SaveCall) -> ray.ObjectRef:
        ref = self.actor.save_checkpoint.remote(save.folder, save.position, save.keep)
        self.calls.submit(CheckpointCall(save, ref=ref, started=self.now()))
        return ref

    # ---- answers -------------------------------------------------------------------------
    def on_trained(self, metrics: dict[str, Any], call: StepCall) -> None:
        self.published = call.step.version + 1
        self.weights.publish(self.published, call.weights)
        recorder = self.driver.recorder
        recorder.step_metrics(self._step_metrics(metrics))
        if self.on_publish is not None:  # before the controller can queue the next step
            self.on_publish(self.published)
        self.driver.train_done(TrainDone(self.published, self.now()))
        if self.on_step is not None:
            self.on_step(recorder.steps[-1], call.step.groups)

    def on_saved(self, path: str, call: CheckpointCall) -> None:
        """A checkpoint is complete: a new trainer would start from it (or a newer one)."""
        if self.log is not None:
            self.log.durable(call.save.version)

    def _step_metrics(self, metrics: dict[str, Any]) -> dict[str, Any]:
        metrics = {k: v for k, v in metrics.items() if k != "version"}  # the recorder's own
        metrics["reward_errors"] = self.plan.reward_errors
        metrics["env_errors"] = self.plan.env_errors
        metrics |= self.plan.episode_counts
        if "train_paced_s" in metrics:
            train = PaceStats()
            train.record(metrics["train_compute_s"], metrics["train_paced_s"])
            self.pace.add("train", train)
        if self.pace.paced:
            metrics |= self.pace.take_step()
        return metrics
