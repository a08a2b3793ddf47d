"""Ray runtime: the driver's commands executed by engine actors and a trainer actor.

A run is a `RayRunPlan`; `RayRuntime` builds its parts from it, each with what it needs:
its `Recorder`, the weights' transport (`transport` says which, dorarl.runtime.transfer.weights),
and the `Driver` (controller, recorder and the run's books, exactly as in the simulator),
which makes its executors with itself, so they answer to it: `EngineFleet` for rollout
commands, `TrainerClient` for training. Its event source is a loop over `ray.wait` on the
calls in flight (`CallTable`) and the controller's timers. It adds no policy: it places,
moves, interrupts and trains what it is told. Paced workers (device emulation) report
real compute against device time; every step's metrics carry both (`pace_engine`,
`pace_train`). A dead engine is replaced (dorarl.runtime.recovery.engine_recovery), and so is a dead
trainer (dorarl.runtime.recovery.trainer_recovery). A run with a reward model scores
every sample on its actor before the driver hears of it (dorarl.runtime.reward_scoring).

Jobs and tests use its parts: `driver` (the controller, `should_stop`, `stopped`),
`engines` (the engine actors), `trainer_client` (the trainer actor, the `published`
version, checkpoints), `weights` (a version's weights for the evaluator), `recorder`,
`rollout` (`reward_errors`) and `pace`.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import ray

from dorarl.config import ConfigError
from dorarl.controller import TRAINER, ControllerConfig, Timer
from dorarl.data import Sample, SavedGroup
from dorarl.driver import Driver, Executor
from dorarl.engine.capabilities import DORARL_CAPABILITIES, Capabilities
from dorarl.engine.outputs import EngineSetup
from dorarl.errors import UserInputError, WorkerFailed
from dorarl.record import Recorder
from dorarl.record.pacing import PaceTally
from dorarl.runtime.calls import (
    DEATHS,
    Call,
    CallTable,
    CheckpointCall,
    EngineCall,
    LoadCall,
    MigrateCall,
    ReplayCall,
    RestoreCall,
    RunCall,
    SendCall,
    StepCall,
    TrainerCall,
)
from dorarl.runtime.death_cause import death_cause
from dorarl.runtime.engines import STEPS_PER_CALL, EngineFleet
from dorarl.runtime.recovery.engine_recovery import InstanceRecovery
from dorarl.runtime.recovery.trainer_log import TrainerLog
from dorarl.runtime.recovery.trainer_recovery import TrainerRecovery, trainer_died
from dorarl.runtime.reward_scoring import RewardModelScoring
from dorarl.runtime.rollout import RolloutPlan, RolloutSettings
from dorarl.runtime.trainer_client import PublishHook, StepHook, TrainerClient
from dorarl.runtime.transfer.transports import make_transport
from dorarl.runtime.transfer.weights import WeightTransport
from dorarl.runtime.transfer.weights_config import TransportSpec
from dorarl.tasks import Task
from dorarl.tasks.reward_model import RewardModelSpec

__all__ = ["STEPS_PER_CALL", "RayRunPlan", "RayRuntime", "Restarts", "RolloutSettings"]


@dataclass(frozen=True)
class Restarts:
    """How a dead actor is replaced. Up to `engines` engines, each by
    `respawn_engine(instance_id)`; up to `trainer` times the trainer, by
    `respawn_trainer(folder)` restored from the newest checkpoint under `checkpoints`
    (None: from the run's start point). Without a budget and its function a death stops
    the run."""

    engines: int = 0
    respawn_engine: Callable[[int], Any] | None = None
    trainer: int = 0
    respawn_trainer: Callable[[str | None], Any] | None = None
    checkpoints: Path | None = None

    @property
    def replaces_trainer(self) -> bool:
        return self.respawn_trainer is not None and self.trainer > 0


@dataclass(frozen=True)
class RayRunPlan:
    """One run on Ray: what `RayRuntime` builds its parts from."""

    controller: ControllerConfig
    task: Task
    rollout: RolloutSettings
    workers: Sequence[Any]
    """The engine actors, by instance id."""
    trainer: Any
    """The trainer actor."""
    restarts: Restarts = field(default_factory=Restarts)
    transport: TransportSpec = field(default_factory=TransportSpec)
    max_model_len: int = 1 << 30
    """The engines' context: an episode whose next turn would pass it ends."""
    steps_per_call: int = STEPS_PER_CALL
    capabilities: Capabilities = DORARL_CAPABILITIES
    """What the engines can do (engine.backend): how a migration moves, who serves weights."""
    out_dir: Path | None = None
    """The recorder's run folder (None: no files)."""
    records_dir: Path | None = None
    """Where summary.json and trace.json go (None: `out_dir`)."""
    texts: Callable[[Sample], dict[str, str]] | None = None
    """A sample's text fields in trajectories.jsonl (record.text)."""
    carried: Sequence[SavedGroup] = ()
    """Complete groups a stopped run's checkpoint kept, queued again at the start."""
    stop_timeout_s: float = float("inf")
    """How long a stop waits for the requests in flight to finish."""
    reward_model: RewardModelSpec | None = None
    """A reward model scoring every sample on its own actor (None: the task's rewards)."""


class RayRuntime:
    """Runs one training job on Ray; `run()` returns the recorder's summary. `on_step` and
    `on_publish` are the trainer client's hooks (dorarl.runtime.trainer_client);
    `should_stop` is polled: once true nothing new is dispatched, the training step and the
    requests in flight finish and the run ends there (`driver.stopped`)."""

    # The overheads this runtime measures, and its Recorder reports. No free_cache: a
    # request's KV blocks go back to the pool as it leaves an engine, inside the engine step,
    # migration or interrupt that removes it, so a version change has nothing left to free.
    OVERHEAD_KINDS = ("load_balance", "request_transfer")

    engines: EngineFleet
    trainer_client: TrainerClient

    def __init__(
        self,
        plan: RayRunPlan,
        *,
        on_step: StepHook | None = None,
        on_publish: PublishHook | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        config = plan.controller
        self.t0 = time.monotonic()
        self.started = False
        self.calls = CallTable()
        self.timers: list[float] = []  # due times of the controller's timers, a heap
        self.pace = PaceTally()
        self.recorder = _recorder(plan, self.OVERHEAD_KINDS)
        self.rollout = self._rollout(plan)
        self.weights: WeightTransport = make_transport(plan.transport, config.effective_K + 1)
        self.load_timeout_s = plan.transport.timeout_s  # bounds the start's first loads
        log = TrainerLog(config.initial_version) if plan.restarts.replaces_trainer else None

        def executor(driver: Driver) -> Executor:
            """The engines and the trainer, made with the driver they answer to."""
            self.engines = EngineFleet(
                driver, plan.workers, self.calls, self.weights, self.rollout, self.pace,
                steps_per_call=plan.steps_per_call, max_model_len=plan.max_model_len,
                capabilities=plan.capabilities,
            )  # fmt: skip
            self.trainer_client = TrainerClient(
                driver, plan.trainer, self.calls, self.weights, self.rollout, self.pace,
                log=log, on_step=on_step, on_publish=on_publish,
            )  # fmt: skip
            set_timer = partial(heapq.heappush, self.timers)
            return Executor(self.engines, self.trainer_client.train, set_timer)

        self.driver = Driver(
            config,
            self.recorder,
            executor,
            self.now,
            lengths=plan.rollout.forced_lengths,
            seed=plan.rollout.seed,
            should_stop=should_stop,
            carried=plan.carried,
            stop_timeout_s=plan.stop_timeout_s,
        )
        self.recovery = self._engine_recovery(plan.restarts)
        self.trainer_recovery = self._trainer_recovery(plan.restarts, log)
        self._answers = self._answer_table()

    def _rollout(self, plan: RayRunPlan) -> RolloutPlan:
        """The rollout plan, with the reward model's scoring where the run has one."""
        rollout = RolloutPlan(plan.task, plan.rollout)
        if plan.reward_model is not None:
            rollout.reward_model = RewardModelScoring(
                plan.reward_model, rollout.reward_texts, self.recorder, self.now
            )
        return rollout

    def _engine_recovery(self, restarts: Restarts) -> InstanceRecovery | None:
        if restarts.respawn_engine is None or not restarts.engines:
            return None
        return InstanceRecovery(
            self.engines, self.driver, restarts.respawn_engine, restarts.engines
        )

    def _trainer_recovery(
        self, restarts: Restarts, log: TrainerLog | None
    ) -> TrainerRecovery | None:
        if restarts.respawn_trainer is None or log is None:
            return None
        return TrainerRecovery(
            self.trainer_client, log, self.calls, self.recorder,
            restarts.respawn_trainer, restarts.checkpoints, restarts.trainer,
        )  # fmt: skip

    def now(self) -> float:
        return time.monotonic() - self.t0

    # ---- the loop ------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Start (unless `start` was called), run to `Finish` or a stop, close."""
        try:
            if not self.started:
                self.start()
            self.driver.loop(self.poll)
        finally:
            if self.rollout.reward_model is not None:
                self.rollout.reward_model.close()
        return self.recorder.close(self.now())

    def start(self) -> None:
        """Wait for every actor to be up (each engine's set-up goes to the recorder), start
        the clock, deliver Start (the first dispatches go out)."""
        workers = self.engines.workers
        if self.rollout.reward_model is not None:
            self.rollout.reward_model.start()
        for iid, setup in enumerate(_started(workers)):
            self.recorder.engine_setup(iid, setup.as_dict())
        self.weights.start(self.trainer_client.actor, workers)
        self.trainer_client.start()
        self._host_first(self.load_timeout_s)
        self.t0 = time.monotonic()
        self.started = True
        self.driver.start()

    def _host_first(self, timeout_s: float) -> None:
        """Every engine holds the run's first version before the first dispatch (a failed
        load stops the run in one line naming the engine)."""
        what = "an engine (loading the run's first version)"
        try:
            self.engines.host_first(self.driver.config.initial_version, timeout_s)
        except ray.exceptions.RayTaskError as exc:
            raise WorkerFailed(what, _describe(exc)) from exc
        except (ray.exceptions.RayError, TimeoutError) as exc:  # a death, or no answer in time
            raise WorkerFailed(what, f"{type(exc).__name__}: {exc}") from exc

    def poll(self) -> None:
        """Fire due timers, then hand every answer that is in to its handler."""
        while self.timers and self.timers[0] <= self.now() and not self.driver.finished:
            heapq.heappop(self.timers)
            self.driver.deliver(Timer(self.now()))
        for ref in self._ready():
            self.answer(ref)
        self.engines.poll_envs()
        self.engines.poll_rewards()

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
        if self.recovery is not None and isinstance(call, EngineCall) and self.engines.stale(call):
            self.recovery.redo(call)  # answered by an actor replaced since
            return
        self._answers[type(call)](result, call)

    def _ready(self) -> list[ray.ObjectRef]:
        timeout = 1.0 if not self.timers else max(0.0, min(1.0, self.timers[0] - self.now()))
        if self.engines.envs_pending:  # episodes wait on their envs: answer them promptly
            timeout = min(timeout, 0.005)
        if self.rollout.scoring:  # samples wait on the reward model (its answers: poll_rewards)
            timeout = min(timeout, 0.01)
        if len(self.calls) == 0:
            if not self.timers and not self.engines.envs_pending and not self.rollout.scoring:
                counts = self.driver.controller.counts()
                raise RuntimeError(f"deadlock: nothing in flight, {counts}")
            time.sleep(timeout)
            return []
        return self.calls.ready(timeout)

    def _failed(self, call: Call, exc: Exception) -> None:
        if isinstance(call, RestoreCall) and self._restore_redone(call, exc):
            return
        if isinstance(call, LoadCall) and self._trainer_died_serving(call, exc):
            self._recover_trainer_then_load(call, exc)
            return
        recovery = self.trainer_recovery if isinstance(call, TrainerCall) else self.recovery
        cause = death_cause(exc) if _a_death(exc) else ""
        recovered = (
            recovery is not None
            and recovery.recoverable(call, exc)
            and recovery.on_failure(call, cause)
        )
        if not recovered:
            if cause:
                self.recorder.died(call.worker, cause, self.now())
            raise WorkerFailed(call.worker, _describe(exc)) from exc

    def _restore_redone(self, call: RestoreCall, exc: Exception) -> bool:
        """A replacement's restore refused or timed out: the replacement is replaced (a
        death goes the way of every engine call's)."""
        if _a_death(exc) or self.recovery is None:
            return False
        return self.recovery.on_restore_failed(call, _describe(exc).split("\n")[0])

    def _trainer_died_serving(self, call: LoadCall, exc: Exception) -> bool:
        """A load from the trainer that failed because the trainer is gone. Over the
        collective transport the live trainer sends each load, so its death can surface
        here first, while no training call is in flight to reveal it (the object store's
        copies outlive it: there, such a load does not fail)."""
        return call.source == TRAINER and _death_inside(exc) and not self.trainer_client.alive()

    def _recover_trainer_then_load(self, call: LoadCall, exc: Exception) -> None:
        """Replace the trainer as if a training call had failed, then load again: from the
        new trainer, which serves each version once its replay has made it again."""
        trainer = self.trainer_recovery
        if trainer is None or not trainer.on_failure(call, death_cause(exc)):
            raise WorkerFailed("the trainer (serving a weight load)", _describe(exc)) from exc
        if self.recovery is not None:
            self.recovery.redo(call)
        elif self.weights.has(call.version):
            self.engines.load(call.iid, call.version, TRAINER)
        else:
            raise WorkerFailed(f"engine instance {call.iid} (weight load)", _describe(exc)) from exc

    def _answer_table(self) -> dict[type[Call], Callable[[Any, Any], None]]:
        engines, trainer = self.engines, self.trainer_client
        answers: dict[type[Call], Callable[[Any, Any], None]] = {
            RunCall: engines.on_run,
            LoadCall: engines.on_loaded,
            RestoreCall: engines.on_restored,
            MigrateCall: engines.on_migrated,
            SendCall: engines.on_sent,
            StepCall: trainer.on_trained,
            CheckpointCall: trainer.on_saved,
        }
        if self.trainer_recovery is not None:  # replays come from a replacement trainer only
            answers[ReplayCall] = self.trainer_recovery.on_replayed
        return answers


def _recorder(plan: RayRunPlan, overheads: tuple[str, ...]) -> Recorder:
    """The run's recorder, as the controller's config describes the run."""
    config = plan.controller
    return Recorder(
        plan.out_dir,
        mode=config.mode,
        k=config.effective_K,
        num_instances=config.instances,
        slots_per_instance=config.slots,
        first_version=config.initial_version,
        versions_per_instance=config.versions_per_instance,
        overhead_kinds=overheads,
        texts=plan.texts,
        records_dir=plan.records_dir,
    )


def _started(workers: list[Any]) -> list[EngineSetup]:
    """Every engine's set-up, once it is up; a setting an engine refused at start is raised
    as itself (one line, exit 2), not as Ray's report of a failed call."""
    try:
        return ray.get([w.started.remote() for w in workers])
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, ConfigError | UserInputError):
            raise exc.cause from None
        raise


def _death_inside(exc: Exception) -> bool:
    """The called actor ran and raised the death of an actor it called in turn (not its own
    death: that is a bare ActorDiedError, which engine recovery handles)."""
    return isinstance(exc, ray.exceptions.RayTaskError) and isinstance(
        getattr(exc, "cause", None), DEATHS
    )


def _a_death(exc: Exception) -> bool:
    """Whether `exc` reports a worker process's death (its own, or one it saw)."""
    return isinstance(exc, DEATHS) or _death_inside(exc) or trainer_died(exc)


def _describe(exc: Exception) -> str:
    """The worker's own exception first (a RayTaskError's first line is Ray's call header;
    a death: why it died, in one line), then Ray's full report with the remote traceback."""
    cause = getattr(exc, "cause", None)
    head = f"{type(cause).__name__}: {cause}" if cause is not None else type(exc).__name__
    if isinstance(exc, DEATHS):
        head = f"{type(exc).__name__}: {death_cause(exc)}"
    return f"{head}\n\n{exc}"
