"""A run's actors on Ray: the engines, the trainer and the evaluator, started from their
specs in the run's reservation, and how to make an engine or the trainer again in the same
bundle when one dies (recovery)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dorarl.jobs.config import TrainConfig
from dorarl.jobs.engine_plan import engines_start_at
from dorarl.jobs.eval_actor import evaluator_spec
from dorarl.jobs.resume import ResumePoint
from dorarl.record.pacing import DeviceModel
from dorarl.runtime.actor_pool import IdlePool, idle_actors, stop_actors
from dorarl.runtime.actors import (
    EngineSpec,
    EvaluatorSpec,
    TrainerSpec,
    spawn_engine,
    spawn_evaluator,
    spawn_trainer,
)
from dorarl.runtime.malloc import preload_library
from dorarl.runtime.placement import PlacedActors
from dorarl.runtime.ray_runtime import Restarts
from dorarl.runtime.threads import share_threads
from dorarl.tasks import Task


@dataclass
class RayActors:
    """The engines, the trainer and the evaluator, and how to make an engine or the trainer
    again in the same bundle (recovery)."""

    workers: list[Any]
    trainer: Any
    evaluator: Any  # None with eval.every=off
    engine: EngineSpec
    trainer_spec: TrainerSpec
    pace: DeviceModel | None
    placed: PlacedActors
    evaluator_spec: EvaluatorSpec
    replacements: list[Any] = field(default_factory=list)  # made by recovery, mid-run
    pool: IdlePool | None = None  # where the actors came from and go back to, when kept
    finished: bool = False  # the run ended cleanly: its actors are idle, fit to be kept

    @classmethod
    def start(
        cls,
        config: TrainConfig,
        model_folder: str,
        task: Task,
        point: ResumePoint | None,
        placed: PlacedActors,
        pace: DeviceModel | None,
        kept_ray: bool = False,
    ) -> RayActors:
        """The run's actors; in a Ray the process keeps (`kept_ray`), idle ones of its
        earlier runs built again where it keeps them (dorarl.runtime.actor_pool)."""
        pool = idle_actors() if kept_ray else None
        start = engines_start_at(config, point)
        threads = share_threads(config.ray.threads_per_actor, config.instances)
        preload = preload_library(config.ray.allocator)
        evaluator = evaluator_spec(config, model_folder, task, threads, point, preload)
        engine = EngineSpec(
            model_folder, config.engine, threads.engine, start, threads.engine_nice, preload
        )
        resume_from = str(point.folder) if point else None
        trainer = TrainerSpec(model_folder, config.trainer, threads.trainer, resume_from, preload)
        workers = [spawn_engine(i, engine, pace, placed, pool) for i in range(config.instances)]
        trainer_actor = spawn_trainer(trainer, pace, placed, pool)
        evaluating = config.eval.every != "off"
        evaluator_actor = spawn_evaluator(evaluator, placed, pool) if evaluating else None
        return cls(
            workers, trainer_actor, evaluator_actor, engine, trainer, pace, placed, evaluator,
            pool=pool,
        )  # fmt: skip

    def by_role(self) -> dict[str, list[Any]]:
        roles = {"engine": self.workers, "trainer": [self.trainer]}
        return roles | ({"evaluator": [self.evaluator]} if self.evaluator is not None else {})

    def respawn_engine(self, instance_id: int) -> Any:
        engine = spawn_engine(instance_id, self.engine, self.pace, self.placed)
        self.replacements.append(engine)
        return engine

    def respawn_trainer(self, checkpoint: str | None) -> Any:
        """A new trainer from `checkpoint`, or from where this run started (None)."""
        spec = self.trainer_spec.restored(checkpoint)
        trainer = spawn_trainer(spec, self.pace, self.placed)
        self.replacements.append(trainer)
        return trainer

    def respawn_evaluator(self) -> Any:
        """A new evaluator in the dead one's bundle (it starts on the run's first weights)."""
        evaluator = spawn_evaluator(self.evaluator_spec, self.placed)
        self.replacements.append(evaluator)
        return evaluator

    def stop(self) -> None:
        """Kill every actor the run made, replacements included (a trainer group's other
        ranks are its rank 0's and go with it); killing one already dead does nothing. A
        run that finished gives its pool's actors back to it, idle, instead."""
        made = [a for a in (*self.workers, self.trainer, self.evaluator, *self.replacements)
                if a is not None]  # fmt: skip
        stop_actors(made, self.pool, keep=self.finished)

    def restarts(self, config: TrainConfig, checkpoints: Path) -> Restarts:
        """Replacing dead actors with these, within the config's budgets."""
        return Restarts(
            engines=config.ray.max_engine_restarts,
            respawn_engine=self.respawn_engine,
            trainer=config.ray.max_trainer_restarts,
            respawn_trainer=self.respawn_trainer,
            checkpoints=checkpoints,
        )
