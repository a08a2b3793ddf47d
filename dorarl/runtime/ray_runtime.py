"""Ray runtime: the driver's commands executed by engine actors and a trainer actor.

The `Driver` owns the controller, the recorder and the run's books, exactly as in the
simulator; this runtime adds its executors (`EngineFleet` for rollout commands,
`TrainerClient` for training, weights through a `WeightTransport`: `transport` says
which, dorarl.runtime.weights) and its event source:
a loop over `ray.wait` on the calls in flight (`CallTable`) and the controller's timers.
It adds no policy: it places, moves, interrupts and trains what it is told. Paced workers
(device emulation) report real compute against device time; every step's metrics carry
both (`pace_engine`, `pace_train`). A dead engine is replaced (dorarl.runtime.recovery),
and so is a dead trainer (dorarl.runtime.trainer_recovery).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from dorarl.config import ConfigError
from dorarl.controller import (
    TRAINER,
    Controller,
    ControllerConfig,
    Dispatch,
    Interrupt,
    LoadWeights,
    Migrate,
    Offload,
    Resume,
    Timer,
)
from dorarl.data import Group
from dorarl.driver import Driver, RequestSpec
from dorarl.engine.outputs import EngineSetup
from dorarl.errors import UserInputError, WorkerFailed
from dorarl.record import Recorder
from dorarl.record.pacing import PaceTally
from dorarl.runtime.calls import DEATHS, ENGINE_KINDS, TRAINER_KINDS, Call, CallTable
from dorarl.runtime.engines import STEPS_PER_CALL, EngineFleet
from dorarl.runtime.recovery import InstanceRecovery
from dorarl.runtime.rollout import RolloutPlan, RolloutSettings
from dorarl.runtime.trainer_client import StepHook, TrainerClient
from dorarl.runtime.trainer_recovery import TrainerRecovery
from dorarl.runtime.transports import make_transport
from dorarl.runtime.weights import WeightTransport
from dorarl.runtime.weights_config import TransportSpec
from dorarl.tasks import Task

__all__ = ["STEPS_PER_CALL", "RayRuntime", "RolloutSettings"]


class RayRuntime:
    """Runs one training job on Ray; `run()` returns the recorder's summary."""

    # The overheads this runtime measures; build its Recorder with them. No free_cache: a
    # request's KV blocks go back to the pool as it leaves an engine, inside the engine step,
    # migration or interrupt that removes it, so a version change has nothing left to free.
    OVERHEAD_KINDS = ("load_balance", "request_transfer")

    def __init__(
        self,
        controller_config: ControllerConfig,
        task: Task,
        rollout: RolloutSettings,
        engine_workers: list[Any],
        trainer: Any,
        recorder: Recorder,
        *,
        on_step: StepHook | None = None,
        on_publish: Callable[[int], None] | None = None,
        steps_per_call: int = STEPS_PER_CALL,
        respawn: Callable[[int], Any] | None = None,
        max_restarts: int = 0,
        respawn_trainer: Callable[[str | None], Any] | None = None,
        max_trainer_restarts: int = 0,
        checkpoints: Path | None = None,
        max_model_len: int = 1 << 30,
        transport: TransportSpec | None = None,
    ) -> None:
        _check_overheads(recorder)
        self.t0 = time.monotonic()
        self.started = False
        self.calls = CallTable()
        self.timers: list[float] = []
        self.pace = PaceTally()
        self.plan = RolloutPlan(task, rollout)
        window = controller_config.effective_K + 1
        self.weights: WeightTransport = make_transport(transport or TransportSpec(), window)
        self.engines = EngineFleet(
            engine_workers,
            controller_config,
            self.calls,
            self.weights,
            self.plan,
            self.pace,
            self.now,
            steps_per_call,
            max_model_len=max_model_len,
        )
        start = controller_config.initial_version
        self.trainer_client = TrainerClient(
            trainer, start, self.calls, self.weights, self.plan, self.pace, self.now
        )
        self.trainer_client.on_step, self.trainer_client.on_publish = on_step, on_publish
        executor = _RayExecutor(self.engines, self.trainer_client, self.timers)
        self.driver = Driver(
            controller_config,
            recorder,
            executor,
            self.now,
            lengths=rollout.forced_lengths,
            seed=rollout.seed,
        )
        self.engines.driver = self.trainer_client.driver = self.driver
        self.recovery = (
            InstanceRecovery(self.engines, self.driver, respawn, max_restarts)
            if respawn and max_restarts
            else None
        )
        self.trainer_recovery = self._trainer_recovery(
            respawn_trainer, max_trainer_restarts, checkpoints
        )
        self._answers = self._answer_table()

    def _trainer_recovery(
        self, respawn: Callable[[str | None], Any] | None, restarts: int, folder: Path | None
    ) -> TrainerRecovery | None:
        if not (respawn and restarts):
            return None
        client, recorder = self.trainer_client, self.driver.recorder
        return TrainerRecovery(client, self.calls, recorder, respawn, folder, restarts)

    def now(self) -> float:
        return time.monotonic() - self.t0

    # ---- what jobs and tests use ---------------------------------------------------------
    @property
    def controller(self) -> Controller:
        return self.driver.controller

    @property
    def recorder(self) -> Recorder:
        return self.driver.recorder

    @property
    def workers(self) -> list[Any]:
        """The engine actors, by instance id (a replaced one is the new actor)."""
        return self.engines.workers

    @property
    def trainer(self) -> Any:
        """The trainer actor (a replaced one is the new actor)."""
        return self.trainer_client.actor

    @property
    def published(self) -> int:
        return self.trainer_client.published

    @property
    def stopped(self) -> bool:
        return self.driver.stopped

    @property
    def reward_errors(self) -> int:
        return self.plan.reward_errors

    @property
    def env_errors(self) -> int:
        """Episodes (of a multi-turn task) that their environment's failure ended."""
        return self.plan.env_errors

    @property
    def should_stop(self) -> Callable[[], bool]:
        """Polled: once true nothing new is dispatched, the training step in flight (if
        any) finishes and the run ends there (`stopped`)."""
        return self.driver.should_stop

    @should_stop.setter
    def should_stop(self, should_stop: Callable[[], bool]) -> None:
        self.driver.should_stop = should_stop

    @property
    def on_step(self) -> StepHook | None:
        """Called after each step's TrainDone with its metrics row and its groups."""
        return self.trainer_client.on_step

    @on_step.setter
    def on_step(self, hook: StepHook | None) -> None:
        self.trainer_client.on_step = hook

    @property
    def on_publish(self) -> Callable[[int], None] | None:
        """Called with each new version before the controller hears of it."""
        return self.trainer_client.on_publish

    @on_publish.setter
    def on_publish(self, hook: Callable[[int], None] | None) -> None:
        self.trainer_client.on_publish = hook

    def weights_of(self, version: int) -> ray.ObjectRef:
        """The trainer's weights of a published version still in the window."""
        return self.weights.trainer_copy(version)

    def save_checkpoint(
        self, folder: str | Path, position: dict[str, Any], keep: int
    ) -> ray.ObjectRef:
        """Queue a checkpoint of the published version with its data position `position`."""
        return self.trainer_client.save_checkpoint(folder, position, keep)

    # ---- the loop ------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Start (unless `start` was called), run to `Finish` or a stop, close."""
        if not self.started:
            self.start()
        self.driver.loop(self.poll)
        return self.recorder.close(self.now())

    def start(self) -> None:
        """Wait for every actor to be up (each engine's set-up goes to the recorder), start
        the clock, deliver Start (the first dispatches go out)."""
        for iid, setup in enumerate(_started(self.workers)):
            self.recorder.engine_setup(iid, setup.as_dict())
        self.weights.start(self.trainer, self.workers)
        self.trainer_client.start()
        self.t0 = time.monotonic()
        self.started = True
        self.driver.start()

    def poll(self) -> None:
        """Fire due timers, then hand every answer that is in to its handler."""
        while self.timers and self.timers[0] <= self.now() and not self.driver.finished:
            heapq.heappop(self.timers)
            self.driver.deliver(Timer(self.now()))
        for ref in self._ready():
            self.answer(ref)
        self.engines.poll_envs()

    def answer(self, ref: ray.ObjectRef) -> None:
        """Act on the answer of one call in flight (nothing if recovery dropped it)."""
        call = self.calls.take(ref)
        if call is None:
            return
        try:
            result = ray.get(ref)
        except ray.exceptions.RayError as exc:
            self._failed(call, exc)
            return
        if self.recovery is not None and call.kind in ENGINE_KINDS and self.engines.stale(call):
            self.recovery.redo(call)  # answered by an actor replaced since
            return
        self._answers[call.kind](result, call)

    def _ready(self) -> list[ray.ObjectRef]:
        timeout = 1.0 if not self.timers else max(0.0, min(1.0, self.timers[0] - self.now()))
        if self.engines.envs_pending:  # episodes wait on their envs: answer them promptly
            timeout = min(timeout, 0.005)
        if len(self.calls) == 0:
            if not self.timers and not self.engines.envs_pending:
                raise RuntimeError(f"deadlock: nothing in flight, {self.controller.counts()}")
            time.sleep(timeout)
            return []
        return self.calls.ready(timeout)

    def _failed(self, call: Call, exc: Exception) -> None:
        if self._trainer_died_serving(call, exc):
            self._recover_trainer_then_load(call, exc)
            return
        recovery = self.trainer_recovery if call.kind in TRAINER_KINDS else self.recovery
        recovered = (
            recovery is not None and recovery.recoverable(call, exc) and recovery.on_failure(call)
        )
        if not recovered:
            raise WorkerFailed(_worker_of(call), _describe(exc)) from exc

    def _trainer_died_serving(self, call: Call, exc: Exception) -> bool:
        """A load from the trainer that failed because the trainer is gone. Over the
        collective transport the live trainer sends each load, so its death can surface
        here first, while no training call is in flight to reveal it (the object store's
        copies outlive it: there, such a load does not fail)."""
        return (
            call.kind == "load"
            and call.args[2] == TRAINER
            and _death_inside(exc)
            and not self.trainer_client.alive()
        )

    def _recover_trainer_then_load(self, call: Call, exc: Exception) -> None:
        """Replace the trainer as if a training call had failed, then load again: from the
        new trainer, which serves each version once its replay has made it again."""
        trainer = self.trainer_recovery
        if trainer is None or not trainer.on_failure(call):
            raise WorkerFailed("the trainer (serving a weight load)", _describe(exc)) from exc
        iid, version, _ = call.args
        if self.recovery is not None:
            self.recovery.redo(call)
        elif self.trainer_client.weights.has(version):
            self.engines.load(iid, version, TRAINER)
        else:
            raise WorkerFailed(f"engine instance {iid} (weight load)", _describe(exc)) from exc

    def _answer_table(self) -> dict[str, Callable[[Any, Call], None]]:
        recovery = self.trainer_recovery
        return {
            "run": self.engines.on_run,
            "load": self.engines.on_loaded,
            "migrate": self.engines.on_migrated,
            "train": self.trainer_client.on_trained,
            "replay": recovery.on_replayed if recovery else _ignore,
            "save": recovery.on_saved if recovery else _ignore,
        }


class _RayExecutor:
    """The driver's executor: rollout commands to the engines, Train to the trainer."""

    def __init__(self, engines: EngineFleet, trainer: TrainerClient, timers: list[float]):
        self.engines, self.trainer_client, self.timers = engines, trainer, timers

    def dispatch(self, command: Dispatch, requests: list[RequestSpec]) -> None:
        self.engines.dispatch(command, requests)

    def load_weights(self, command: LoadWeights) -> None:
        self.engines.load_weights(command)

    def migrate(self, command: Migrate) -> None:
        self.engines.migrate(command)

    def interrupt(self, command: Interrupt) -> None:
        self.engines.interrupt(command)

    def resume(self, command: Resume) -> None:
        self.engines.resume(command)

    def offload(self, command: Offload) -> None:
        self.engines.offload(command)

    def train(self, version: int, groups: list[Group]) -> None:
        self.trainer_client.train(version, groups)

    def set_timer(self, at: float) -> None:
        heapq.heappush(self.timers, at)


def _started(workers: list[Any]) -> list[EngineSetup]:
    """Every engine's set-up, once it is up; a setting an engine refused at start is raised
    as itself (one line, exit 2), not as Ray's report of a failed call."""
    try:
        return ray.get([w.started.remote() for w in workers])
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, ConfigError | UserInputError):
            raise exc.cause from None
        raise


def _check_overheads(recorder: Recorder) -> None:
    if tuple(recorder.overhead_kinds) != RayRuntime.OVERHEAD_KINDS:
        raise ValueError(
            f"RayRuntime measures the overheads {RayRuntime.OVERHEAD_KINDS}; its Recorder "
            f"reports {recorder.overhead_kinds} (pass overhead_kinds=RayRuntime.OVERHEAD_KINDS)"
        )


def _ignore(result: Any, call: Call) -> None:
    return None


def _worker_of(call: Call) -> str:
    """The worker a call ran on, for error messages."""
    if call.kind in ("train", "replay"):
        return f"the trainer (training step {call.args[0]})"
    if call.kind == "save":
        return f"the trainer (checkpoint of version {call.args[0].version})"
    if call.kind == "migrate":
        return f"engine instance {call.args[0]} or {call.args[1]} (request migration)"
    work = "weight load" if call.kind == "load" else "decoding"
    return f"engine instance {call.args[0]} ({work})"


def _death_inside(exc: Exception) -> bool:
    """The called actor ran and raised the death of an actor it called in turn (not its own
    death: that is a bare ActorDiedError, which engine recovery handles)."""
    return isinstance(exc, ray.exceptions.RayTaskError) and isinstance(
        getattr(exc, "cause", None), DEATHS
    )


def _describe(exc: Exception) -> str:
    """The worker's own exception first (a RayTaskError's first line is Ray's call header),
    then Ray's full report with the remote traceback."""
    cause = getattr(exc, "cause", None)
    head = f"{type(cause).__name__}: {cause}" if cause is not None else type(exc).__name__
    return f"{head}\n\n{exc}"
