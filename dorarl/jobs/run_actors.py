"""A run's actors on Ray: the engines, the trainer and the evaluator, started from their
specs in the run's reservation, and how to make an engine or the trainer again in the same
bundle when one dies (recovery)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from dorarl.jobs.config import TrainConfig
from dorarl.jobs.engine_plan import engines_start_at
from dorarl.jobs.eval_actor import evaluator_spec
from dorarl.jobs.resume import ResumePoint
from dorarl.record.pacing import DeviceModel
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

    @classmethod
    def start(
        cls,
        config: TrainConfig,
        model_folder: str,
        task: Task,
        point: ResumePoint | None,
        placed: PlacedActors,
        pace: DeviceModel | None,
    ) -> RayActors:
        start = engines_start_at(config, point)
        threads = share_threads(config.ray.threads_per_actor, config.instances)
        preload = preload_library(config.ray.allocator)
        evaluator = evaluator_spec(config, model_folder, task, threads, point, preload)
        engine = EngineSpec(
            model_folder, config.engine, threads.engine, start, threads.engine_nice, preload
        )
        resume_from = str(point.folder) if point else None
        trainer = TrainerSpec(model_folder, config.trainer, threads.trainer, resume_from, preload)
        workers = [spawn_engine(i, engine, pace, placed) for i in range(config.instances)]
        trainer_actor = spawn_trainer(trainer, pace, placed)
        evaluating = config.eval.every != "off"
        evaluator_actor = spawn_evaluator(evaluator, placed) if evaluating else None
        return cls(
            workers, trainer_actor, evaluator_actor, engine, trainer, pace, placed, evaluator
        )

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
        ranks are its rank 0's and go with it); killing one already dead does nothing."""
        for actor in [*self.workers, self.trainer, self.evaluator, *self.replacements]:
            if actor is not None:
                ray.kill(actor, no_restart=True)

    def restarts(self, config: TrainConfig, checkpoints: Path) -> Restarts:
        """Replacing dead actors with these, within the config's budgets."""
        return Restarts(
            engines=config.ray.max_engine_restarts,
            respawn_engine=self.respawn_engine,
            trainer=config.ray.max_trainer_restarts,
            respawn_trainer=self.respawn_trainer,
            checkpoints=checkpoints,
        )
