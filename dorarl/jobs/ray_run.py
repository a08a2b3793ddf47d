"""`dorarl train runtime=ray`: start Ray and the actors, run the controller, evaluate, save.

A run is: its actors (`RayActors`: engines, trainer and evaluator, and how to make each
again), its runtime (`RayRuntime`, built from a `RayRunPlan`), what happens at each new
version (a periodic checkpoint before the controller hears of it; after it, the
evaluation, scalars and progress of the step), and its end (the final checkpoint, the
reward curve, this segment's summary, then the whole run's summary and trace rebuilt from
its segments and its evaluations: dorarl.record.segments). Evaluation runs in its own
actor on the versions it is asked for, so it never stalls rollout or training (each result
is appended to evaluations.jsonl as it finishes); with `defer_eval` it runs after
training, so it takes no CPU from a timed run either. `pace` turns on device emulation
(dorarl.record.pacing) for the engines and the trainer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from dorarl.config import ConfigError
from dorarl.errors import RunFailed, WorkerFailed
from dorarl.jobs.config import TrainConfig
from dorarl.jobs.engine_plan import (
    check_engines,
    engines_start_at,
    model_folder,
    model_spec,
)
from dorarl.jobs.eval_actor import Evaluations, evaluator_spec
from dorarl.jobs.evaluation import eval_versions, finish_outputs, format_scores
from dorarl.jobs.learning_signal import EnvFailed, LearningSignal, check_episodes
from dorarl.jobs.model_defaults import with_model_defaults
from dorarl.jobs.progress import TrainProgress
from dorarl.jobs.resume import ResumePoint, find_checkpoint
from dorarl.jobs.run_folder import open_run_folder, resume_command
from dorarl.jobs.startup import StartupLines, wait_for_actors
from dorarl.jobs.stopping import StopRequest
from dorarl.jobs.workload import build_task, rollout_settings, trajectory_texts
from dorarl.record.pacing import DeviceModel
from dorarl.record.segments import end_segment, open_segment, write_run_records
from dorarl.report.tensorboard import ScalarLogger
from dorarl.run_layout import RunFolder
from dorarl.runtime.actors import (
    EngineSpec,
    TrainerSpec,
    spawn_engine,
    spawn_evaluator,
    spawn_trainer,
)
from dorarl.runtime.local_ray import check_cluster_auth, join_ray, start_local_ray
from dorarl.runtime.placement import PlacedActors, place_actors
from dorarl.runtime.ray_runtime import RayRunPlan, RayRuntime, Restarts
from dorarl.runtime.threads import share_threads
from dorarl.runtime.trainer_client import StepHook
from dorarl.tasks import Task

log = logging.getLogger(__name__)


def run_ray(
    config: TrainConfig,
    point: ResumePoint | None,
    out_dir: Path,
    *,
    pace: DeviceModel | None = None,
    defer_eval: bool = False,
    stop: StopRequest | None = None,
) -> dict[str, Any]:
    """Run from `point` (the checkpoint `config.resume` names, read once by the caller; None: a
    fresh run) to `config.steps`, or until `stop` is requested (then: the step in flight
    ends, a checkpoint of that version is written, the summary says `stopped_by`)."""
    if config.ray.address:  # a cluster that will refuse us says so before the slow part
        check_cluster_auth(config.ray.address)
    folder = model_folder(config, point)
    spec, where = model_spec(folder)  # a model the engine does not run: refused
    check_engines(config, spec, where)  # a fast path the model's heads rule out: refused
    task = build_task(config, folder)  # bad data stops the run before any file is written
    config, chosen = with_model_defaults(config, folder, point)  # config.json holds the choice
    for line in chosen + _versions_line(config):
        print(line)
    if stop is not None and stop.requested():
        raise KeyboardInterrupt  # asked to stop before anything started: nothing to save
    start = point.version if point else 0
    with TrainProgress(config.steps - start, enabled=config.progress) as progress:
        startup = StartupLines(progress.say, progress.phase)
        own_ray = _init_ray(config)
        startup.ray_up(config.ray.address, kept=not own_ray)
        placed: PlacedActors | None = None
        actors: RayActors | None = None
        try:
            placed = place_actors(  # a cluster that cannot hold them: refused
                config.instances, config.engine, config.trainer, config.ray, spec
            )
            open_run_folder(out_dir, config, resume_version=point.version if point else None)
            segment = open_segment(out_dir, start, config.instances, config.engine.max_num_seqs)
            actors = RayActors.start(config, folder, task, point, placed, pace)
            startup.actors_up(wait_for_actors(actors.by_role(), config.ray.startup_timeout_s))
            return _run(
                config, point, out_dir, segment, task, actors,
                progress=progress, startup=startup, defer_eval=defer_eval, stop=stop,
            )  # fmt: skip
        except WorkerFailed as exc:
            raise RunFailed(failure_report(exc, out_dir)) from exc
        finally:
            _leave_ray(own_ray, placed, actors)
            if hasattr(task, "close"):  # task.agent: its endpoint serves for the run only
                task.close()


def _versions_line(config: TrainConfig) -> list[str]:
    """What an engine holding adapters does with them, said once at the start."""
    if not config.adapter_versions:
        return []
    held = config.versions_per_instance
    if held > 1:
        return [f"engines: each holds up to {held} versions as LoRA adapters over the base"]
    window = config.controller_config(None).effective_K + 1
    return [
        f"engines: one version each, its LoRA adapter over the base (a window of {window} "
        f"versions on one engine needs engine.max_versions >= {window + 1})"
    ]


def failure_report(exc: WorkerFailed, out_dir: Path) -> str:
    """Write the worker's full error to the run folder; one line on what failed and how to
    go on from the newest checkpoint."""
    details = RunFolder(out_dir).failure
    details.write_text(f"{exc}\n\n{exc.detail}\n")
    try:
        newest = find_checkpoint(out_dir)
    except ConfigError:
        how = "no checkpoint yet to resume from (checkpoint_every=N writes them along the way)"
    else:
        how = f"resume from {newest.name} with: {resume_command(out_dir)}"
    return f"{exc} (full error in {details}); {how}"


def _init_ray(config: TrainConfig) -> bool:
    """Join `ray.address` or start a local Ray; whether the run did (and so shuts it down at
    its end). A Ray this process had joined before the run (a notebook's, a script's own
    `ray.init`) is used as it is and kept."""
    if ray.is_initialized():
        return False
    if config.ray.address:
        join_ray(config.ray.address)
    else:
        start_local_ray(host=config.ray.host)
    return True


def _leave_ray(own_ray: bool, placed: PlacedActors | None, actors: RayActors | None) -> None:
    """Shut down the Ray the run started or joined (its actors go with it), or, in a Ray the
    process keeps, stop the run's actors and free its reservation."""
    if own_ray:
        ray.shutdown()
        return
    if actors is not None:
        actors.stop()
    if placed is not None:
        placed.release()


# ---- the run's actors --------------------------------------------------------------------
@dataclass
class RayActors:
    """The engines, the trainer and the evaluator, and how to make an engine or the trainer
    again in the same bundle (recovery)."""

    workers: list[Any]
    trainer: Any
    evaluator: Any
    engine: EngineSpec
    trainer_spec: TrainerSpec
    pace: DeviceModel | None
    placed: PlacedActors
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
        evaluator = evaluator_spec(config, model_folder, task, threads, point)
        engine = EngineSpec(model_folder, config.engine, threads.engine, start, threads.engine_nice)
        resume_from = str(point.folder) if point else None
        trainer = TrainerSpec(model_folder, config.trainer, threads.trainer, resume_from)
        workers = [spawn_engine(i, engine, pace, placed) for i in range(config.instances)]
        trainer_actor = spawn_trainer(trainer, pace, placed)
        evaluator_actor = spawn_evaluator(evaluator, placed)
        return cls(workers, trainer_actor, evaluator_actor, engine, trainer, pace, placed)

    def by_role(self) -> dict[str, list[Any]]:
        return {"engine": self.workers, "trainer": [self.trainer], "evaluator": [self.evaluator]}

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

    def stop(self) -> None:
        """Kill every actor the run made, replacements included (a trainer group's other
        ranks are its rank 0's and go with it); killing one already dead does nothing."""
        for actor in [*self.workers, self.trainer, self.evaluator, *self.replacements]:
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


# ---- the run -----------------------------------------------------------------------------
def _run(
    config: TrainConfig,
    point: ResumePoint | None,
    out_dir: Path,
    segment: Path,
    task: Task,
    actors: RayActors,
    *,
    progress: TrainProgress,
    startup: StartupLines,
    defer_eval: bool,
    stop: StopRequest | None,
) -> dict[str, Any]:
    """Run this segment; returns the whole run's summary."""
    plan = _plan(config, point, out_dir, segment, task, actors)
    start = plan.controller.initial_version
    record = RunFolder(out_dir).evaluations
    evals = Evaluations(
        actors.evaluator, eval_versions(config, start), start, defer_eval, record,
        timeout_s=config.eval.timeout_s,
    )  # fmt: skip
    scalars = ScalarLogger(out_dir, use_wandb=config.wandb, run_name=out_dir.name)
    checkpoints = Checkpoints.of(config, out_dir)
    episodes_key = "task.agent" if config.task.agent is not None else "task.env"
    # the hooks run once the runtime runs: `runtime` is bound by then
    runtime = RayRuntime(
        plan,
        on_step=_step_hook(lambda: runtime, evals, scalars, progress, startup, episodes_key),
        on_publish=lambda version: checkpoints.periodic(runtime, version),
        should_stop=stop.requested if stop is not None else None,
    )
    summary = run_segment(runtime, out_dir, segment)
    results = _gather(runtime, evals, progress, checkpoints.off)
    progress.stop()  # the bar ends above the checkpoint and summary lines
    final = runtime.driver.controller.resume_state()  # no step in flight once the run finished
    checkpoints.final(runtime, final)
    title = f"{config.mode} (K={plan.controller.effective_K})"
    for row in finish_outputs(out_dir, results, title):
        scalars.log(row)
    scalars.close()
    if runtime.driver.stopped and stop is not None:
        version = runtime.trainer_client.published
        summary = dict(summary, stopped_by=stop.name, stopped_at_version=version)
        if checkpoints.resumable():
            summary["resume_command"] = resume_command(out_dir)
    return _final_summary(out_dir, segment, summary, runtime)


def run_segment(runtime: RayRuntime, out_dir: Path, segment: Path) -> dict[str, Any]:
    """The runtime's summary; a failed run's segment is recorded as such before it raises
    (an abort's is not: its books may be mid-update, and it leaves at once)."""
    try:
        return runtime.run()
    except (WorkerFailed, EnvFailed):
        _record_failure(runtime, out_dir, segment)
        raise


def _record_failure(runtime: RayRuntime, out_dir: Path, segment: Path) -> None:
    try:
        summary = runtime.recorder.close(runtime.now())
        summary["reward_errors"] = runtime.rollout.reward_errors
        summary["env_errors"] = runtime.rollout.env_errors
        end_segment(segment, summary, "failed", _clock_started(runtime))
        write_run_records(out_dir)
    except Exception:  # the worker's failure is what must reach the user, not this one
        log.warning("could not record the failed segment %s", segment, exc_info=True)


def _clock_started(runtime: RayRuntime) -> float:
    """When the runtime's clock read 0, in seconds since the epoch."""
    return time.time() - runtime.now()


def _plan(
    config: TrainConfig,
    point: ResumePoint | None,
    out_dir: Path,
    segment: Path,
    task: Task,
    actors: RayActors,
) -> RayRunPlan:
    """This segment's run on `actors`, recorded in `out_dir` (its summary and trace in
    `segment`)."""
    return RayRunPlan(
        config.controller_config(point),
        task,
        rollout_settings(config, task),
        actors.workers,
        actors.trainer,
        restarts=actors.restarts(config, RunFolder(out_dir).checkpoints),
        transport=config.weights.spec(
            config.engine.device,
            config.trainer.device,
            config.engine.dtype,
            adapters=config.adapter_versions,
        ),  # fmt: skip
        max_model_len=config.engine.max_model_len,
        out_dir=out_dir,
        records_dir=segment,
        texts=trajectory_texts(task) if config.record.text else None,
    )


def _step_hook(
    runtime_of: Callable[[], RayRuntime],
    evals: Evaluations,
    scalars: ScalarLogger,
    progress: TrainProgress,
    startup: StartupLines,
    episodes_key: str,
) -> StepHook:
    """After each step: evaluate its version if wanted, log its scalars, show progress,
    warn when it cannot learn, stop when its environment (`episodes_key`) failed every
    episode of it (`runtime_of()`: the runtime the hook is given to)."""
    signal = LearningSignal()

    def on_step(row: dict[str, Any], groups: list) -> None:
        version = row["new_version"]
        runtime = runtime_of()
        if version in evals.wanted:  # a copy of the weights only for a version evaluated
            evals.offer(version, runtime.weights.trainer_copy(version))
        scalars.log(row)
        signal.texts_at = runtime.recorder.texts_path  # where its recorder writes the texts
        signal.observe(row)
        finished = evals.finished()
        startup.step(row)
        if finished:
            first = min(finished)
            startup.evaluation(first, finished[first], format_scores(finished[first]))
        progress.update(row, finished)
        check_episodes(row["step"], groups, episodes_key)

    return on_step


def _gather(
    runtime: RayRuntime, evals: Evaluations, progress: TrainProgress, no_checkpoint: bool
) -> dict[int, dict[str, Any]]:
    """The evaluations: all of them, or a stopped run's finished ones (none waited for)."""
    if runtime.driver.stopped:
        version = runtime.trainer_client.published
        writing = "" if no_checkpoint else f": writing the checkpoint of version {version}"
        progress.note(f"stopped{writing}")
        return evals.finished()
    progress.note("final evaluation" + ("" if no_checkpoint else " and checkpoint"))
    return evals.all()


# ---- checkpoints -------------------------------------------------------------------------
@dataclass
class Checkpoints:
    """The run's checkpoint writes: every `checkpoint_every` versions and at the end (or
    none: `off`), each reported in one line once written (path, size on disk, seconds)."""

    every: int | str  # checkpoint_every
    keep: int
    steps: int
    out_dir: Path
    timeout_s: float = 1800.0  # checkpoint_timeout_s: the longest the run's end waits
    pending: list[Any] = field(default_factory=list)  # writes not yet reported

    @classmethod
    def of(cls, config: TrainConfig, out_dir: Path) -> Checkpoints:
        return cls(
            config.checkpoint_every, config.checkpoint_keep, config.steps, out_dir,
            config.checkpoint_timeout_s,
        )  # fmt: skip

    @property
    def off(self) -> bool:
        return self.every == "off"

    def periodic_due(self, version: int, stopping: bool) -> bool:
        """Whether `version` gets a periodic checkpoint. The last version is saved at the
        end, and so is the one a stop ends at: once, not rewritten (a rewrite gains nothing,
        and a trainer restored from a checkpoint pruned since copies its tokenizer files
        from there: none)."""
        every = self.every
        if self.off or stopping or not every or version >= self.steps:
            return False
        return version % every == 0

    def periodic(self, runtime: RayRuntime, version: int) -> None:
        """Before the controller hears of `version` (its data position is the checkpoint's)."""
        self.report(wait=False)
        if self.periodic_due(version, runtime.driver.should_stop()):
            self.pending.append(self._write(runtime, runtime.driver.controller.resume_state()))

    def final(self, runtime: RayRuntime, position: dict[str, Any]) -> None:
        """The end's checkpoint (none when off), waited for, and every write reported; the
        run has ended, so a failure of this one is the run's."""
        self.report(wait=True)
        if not self.off:
            write = self._write(runtime, position)
            ready, _ = ray.wait([write], timeout=self.timeout_s)
            if not ready:
                raise RunFailed(self._late(f"v{position['version']}"))
            print(ray.get(write).line())

    def _late(self, what: str) -> str:
        try:
            newest = f"the newest written is {find_checkpoint(self.out_dir).name}"
        except ConfigError:
            newest = "none was written"
        return (
            f"checkpoint of {what} not written after {self.timeout_s:.0f}s "
            f"(checkpoint_timeout_s); {newest}"
        )

    def _write(self, runtime: RayRuntime, position: dict[str, Any]) -> ray.ObjectRef:
        """Queue a checkpoint of the published version, with the data position to resume
        at (through the runtime, which replays it on a new trainer if this one dies first)."""
        version = runtime.trainer_client.published
        assert position["version"] == version, f"data position of v{position['version']}"
        folder = RunFolder(self.out_dir).checkpoint(version)
        return runtime.trainer_client.save_checkpoint(folder, position, self.keep)

    def report(self, wait: bool) -> None:
        """One line for each periodic write finished (with `wait`: for each, once finished).
        One the trainer died in was made again by trainer recovery as the run went on."""
        if not self.pending:
            return
        timeout = self.timeout_s if wait else 0
        done, self.pending = ray.wait(self.pending, num_returns=len(self.pending), timeout=timeout)
        if wait and self.pending:
            raise RunFailed(self._late(f"{len(self.pending)} periodic write(s)"))
        for ref in done:
            try:
                print(ray.get(ref).line())
            except ray.exceptions.RayError:
                log.warning("a checkpoint write died with its trainer; trainer recovery redid it")

    def resumable(self) -> bool:
        """Whether the run folder holds a checkpoint to resume from."""
        try:
            find_checkpoint(self.out_dir)
        except ConfigError:
            return False
        return True


def _final_summary(
    out_dir: Path,
    segment: Path,
    summary: dict[str, Any],
    runtime: RayRuntime,
) -> dict[str, Any]:
    """Write the segment's summary; returns the whole run's (with the run's evaluations)."""
    summary = dict(summary)
    summary["reward_errors"] = runtime.rollout.reward_errors
    summary["env_errors"] = runtime.rollout.env_errors
    if runtime.pace.paced:
        summary["pace"] = runtime.pace.totals()
    ended = "stopped" if runtime.driver.stopped else "finished"
    end_segment(segment, summary, ended, _clock_started(runtime))
    return write_run_records(out_dir)
