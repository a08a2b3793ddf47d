"""`dorarl train runtime=ray`: start Ray and the actors, run the controller, evaluate, save.

A run is: its actors (`RayActors`, dorarl.jobs.run_actors: engines, trainer and evaluator,
and how to make each again), its runtime (`RayRuntime`, built from a `RayRunPlan`), what
happens at each new version (a periodic checkpoint before the controller hears of it,
dorarl.jobs.checkpoints; after it, the evaluation, scalars and progress of the step), and
its end (the final checkpoint, the
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
from pathlib import Path
from typing import Any

import ray

from dorarl.config import ConfigError
from dorarl.errors import RunFailed, WorkerFailed
from dorarl.jobs.checkpoints import Checkpoints
from dorarl.jobs.config import TrainConfig
from dorarl.jobs.engine_plan import model_folder, model_spec
from dorarl.jobs.eval_actor import Evaluations
from dorarl.jobs.evaluation import eval_versions, finish_outputs, format_scores, held_out_line
from dorarl.jobs.learning_signal import EnvFailed, LearningSignal, check_episodes
from dorarl.jobs.model_context import context_line
from dorarl.jobs.model_defaults import with_model_defaults
from dorarl.jobs.preflight import check_run
from dorarl.jobs.progress import TrainProgress
from dorarl.jobs.resume import ResumePoint, find_checkpoint
from dorarl.jobs.run_actors import RayActors
from dorarl.jobs.run_folder import open_run_folder, resume_command
from dorarl.jobs.startup import StartupLines, wait_for_actors
from dorarl.jobs.stopping import StopRequest
from dorarl.jobs.truncation import TruncationWatch
from dorarl.jobs.workload import reward_model_spec, rollout_settings, trajectory_texts
from dorarl.record.pacing import DeviceModel
from dorarl.record.segments import (
    end_segment,
    open_segment,
    run_books,
    write_run_records,
)
from dorarl.report.tensorboard import ScalarLogger
from dorarl.run_layout import RunFolder
from dorarl.runtime.local_ray import check_cluster_auth, join_ray, start_local_ray
from dorarl.runtime.placement import PlacedActors, place_actors
from dorarl.runtime.ray_runtime import RayRunPlan, RayRuntime
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
    imports_s: float | None = None,
) -> dict[str, Any]:
    """Run from `point` (the checkpoint `config.resume` names, read once by the caller; None: a
    fresh run) to `config.steps`, or until `stop` is requested (then: the step in flight
    ends, a checkpoint of that version is written, the summary says `stopped_by`).
    `imports_s`: what the process took before this call (the command's), in the start-up's
    breakdown."""
    entered = time.monotonic()
    if config.ray.address:  # a cluster that will refuse us says so before the slow part
        check_cluster_auth(config.ray.address)
    task = check_run(config, point)  # every problem, before any file is written
    folder = model_folder(config, point)
    spec, _ = model_spec(folder, config.engine.backend)
    config, chosen = with_model_defaults(config, folder, point)  # config.json holds the choice
    _say_choices(config, task, chosen)
    if stop is not None and stop.requested():
        raise KeyboardInterrupt  # asked to stop before anything started: nothing to save
    start = point.version if point else 0
    with TrainProgress(config.steps - start, enabled=config.progress) as progress:
        startup = _startup_lines(progress, imports_s, checks_s=time.monotonic() - entered)
        own_ray = _init_ray(config)
        startup.ray_up(config.ray.address, kept=not own_ray)
        placed: PlacedActors | None = None
        actors: RayActors | None = None
        try:
            placed = place_actors(  # a cluster that cannot hold them: refused
                config.instances, config.engine, config.trainer, config.ray, spec
            )
            open_run_folder(out_dir, config, resume_version=point.version if point else None)
            segment = _open_segment(config, point, out_dir, start)
            actors = RayActors.start(config, folder, task, point, placed, pace, not own_ray)
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


def _startup_lines(
    progress: TrainProgress, imports_s: float | None, checks_s: float
) -> StartupLines:
    """The start's lines, with the phases before them: the command's imports, the checks."""
    before = {"imports": imports_s} if imports_s is not None else {}
    return StartupLines(progress.say, progress.phase, before | {"checks": checks_s})


def _say_choices(config: TrainConfig, task: Task, chosen: list[str]) -> None:
    """The start's lines on what the run chose and the held-out set it scores; a warning
    when that set is too small to tell versions apart."""
    held_out, few = held_out_line(config, len(task.eval_prompts()))
    context = context_line(config)
    for line in chosen + ([context] if context else []) + _versions_line(config) + [held_out]:
        print(line)
    if few is not None:
        log.warning("%s", few)


def _open_segment(
    config: TrainConfig, point: ResumePoint | None, out_dir: Path, start: int
) -> Path:
    """This process's segment of the run, with the run's group counts its checkpoint holds."""
    slots = config.engine.max_num_seqs
    return open_segment(out_dir, start, config.instances, slots, _books_before(point, out_dir))


def _books_before(point: ResumePoint | None, out_dir: Path) -> dict[str, Any] | None:
    """The run's group counts before this segment: none for a fresh run; a checkpoint's
    of this run folder when it holds them (a stop's); else unknown (None)."""
    if point is None:
        return {}
    own = point.folder.resolve().parent == RunFolder(out_dir).checkpoints.resolve()
    return point.books if own else None


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
    process keeps, stop the run's actors (a finished run's go back idle to the process's
    pool where it keeps them) and free its reservation."""
    if own_ray:
        ray.shutdown()
        return
    if actors is not None:
        actors.stop()
    if placed is not None:
        placed.release()


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
        timeout_s=config.eval.timeout_s, respawn=actors.respawn_evaluator,
    )  # fmt: skip
    scalars = ScalarLogger(out_dir, use_wandb=config.wandb, run_name=out_dir.name)
    checkpoints = Checkpoints.of(config, out_dir)
    # the hooks run once the runtime runs: `runtime` is bound by then
    runtime = RayRuntime(
        plan,
        on_step=_step_hook(lambda: runtime, evals, scalars, progress, startup, config, plan),
        on_publish=lambda version: checkpoints.periodic(runtime, version),
        should_stop=stop.requested if stop is not None else None,
    )
    summary = run_segment(runtime, out_dir, segment) | {"startup": startup.record()}
    results = _gather(runtime, evals, progress, checkpoints.off)
    progress.stop()  # the bar ends above the checkpoint and summary lines
    checkpoints.final(runtime, _final_position(runtime, point, out_dir, summary))
    title = f"{config.mode} (K={plan.controller.effective_K})"
    for row in finish_outputs(out_dir, results, title):
        scalars.log(row)
    _draw_dashboard(out_dir, title)
    scalars.close()
    if runtime.driver.stopped and stop is not None:
        version = runtime.trainer_client.published
        summary = dict(summary, stopped_by=stop.name, stopped_at_version=version)
        if checkpoints.resumable():
            summary["resume_command"] = resume_command(out_dir)
    actors.finished = True  # idle now: they may serve this process's next run
    return _final_summary(out_dir, segment, summary, runtime)


def _final_position(
    runtime: RayRuntime, point: ResumePoint | None, out_dir: Path, summary: dict[str, Any]
) -> dict[str, Any]:
    """The end's data position (no step in flight once the run ended), with the run's group
    counts, so a resume still adds them up should this process die before its summary."""
    final = runtime.driver.resume_state()
    before = _books_before(point, out_dir)
    if before is not None:
        final["books"] = run_books(before, summary)
    return final


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
        summary |= runtime.rollout.episode_counts
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
        capabilities=config.engine.capabilities,
        out_dir=out_dir,
        records_dir=segment,
        texts=trajectory_texts(task) if config.record.text else None,
        carried=point.carried if point else (),
        stop_timeout_s=config.stop_timeout_s,
        reward_model=reward_model_spec(config.task),
    )


def _step_hook(
    runtime_of: Callable[[], RayRuntime],
    evals: Evaluations,
    scalars: ScalarLogger,
    progress: TrainProgress,
    startup: StartupLines,
    config: TrainConfig,
    plan: RayRunPlan,
) -> StepHook:
    """After each step: evaluate its version if wanted, log its scalars, show progress,
    warn when it cannot learn or its responses were cut by a length limit, stop when its
    environment (task.env or task.agent) failed every episode of it (`runtime_of()`: the
    runtime the hook is given to)."""
    signal = LearningSignal()
    truncation = truncation_watch(config, plan.rollout.max_new_tokens)
    episodes_key = "task.agent" if config.task.agent is not None else "task.env"

    def on_step(row: dict[str, Any], groups: list) -> None:
        version = row["new_version"]
        runtime = runtime_of()
        if version in evals.wanted:  # a copy of the weights only for a version evaluated
            weights = runtime.weights
            evals.offer(version, weights.trainer_copy(version), weights.manifest_for(version, None))
        scalars.log(row)
        signal.texts_at = runtime.recorder.texts_path  # where its recorder writes the texts
        signal.observe(row)
        _, cut = truncation.observe(row["step"], groups)
        finished = evals.finished()
        startup.step(row)
        if finished:
            first = min(finished)
            startup.evaluation(first, finished[first], format_scores(finished[first]))
        progress.update(row, finished, flag=cut)
        check_episodes(row["step"], groups, episodes_key)

    return on_step


def truncation_watch(config: TrainConfig, max_new_tokens: int) -> TruncationWatch:
    """The run's watch on cut responses; off under forced lengths, which cut every one."""
    threshold = 1.0 if config.forced_lengths.enabled else config.sampling.warn_truncated
    return TruncationWatch(config.engine.max_model_len, max_new_tokens, threshold)


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


def _draw_dashboard(out_dir: Path, title: str) -> None:
    from dorarl.report.dashboard import write_dashboard  # matplotlib: only once a run ends

    write_dashboard(out_dir, title)


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
    summary |= runtime.rollout.episode_counts
    if runtime.pace.paced:
        summary["pace"] = runtime.pace.totals()
    ended = "stopped" if runtime.driver.stopped else "finished"
    end_segment(segment, summary, ended, _clock_started(runtime))
    return write_run_records(out_dir)
