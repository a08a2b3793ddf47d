"""`dorarl train runtime=ray`: start Ray and the actors, run the controller, evaluate, save.

Evaluation runs in its own actor on the versions it is asked for (the base, every
`eval.every` versions, the last), so it never stalls rollout or training; with
`defer_eval` it runs after training, so it takes no CPU from a timed run either. `pace`
turns on device emulation (dorarl.runtime.pacing) for the engines and the trainer.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from dorarl.config import ConfigError
from dorarl.data import Sample
from dorarl.engine import EngineConfig
from dorarl.errors import RunFailed, WorkerFailed
from dorarl.jobs.config import TrainConfig
from dorarl.jobs.learning_signal import LearningSignal
from dorarl.jobs.progress import TrainProgress
from dorarl.jobs.resume import ResumePoint, find_checkpoint
from dorarl.jobs.run_folder import open_run_folder, resume_command
from dorarl.jobs.stopping import StopRequest
from dorarl.jobs.train import finish_outputs
from dorarl.report.tensorboard import ScalarLogger
from dorarl.runtime.eval_worker import EvalWorker
from dorarl.runtime.local_ray import check_cluster_auth, join_ray, start_local_ray
from dorarl.runtime.pacing import DeviceModel
from dorarl.runtime.placement import PlacedActors
from dorarl.runtime.ray_runtime import (
    RayRuntime,
    RolloutSettings,
    actor_options,
    spawn_engine,
    spawn_trainer,
    start_workers,
)
from dorarl.runtime.recorder import Recorder
from dorarl.runtime.threads import ThreadPlan, share_threads
from dorarl.tasks import Task, make_task
from dorarl.tasks.assets import shipped_base_model


def build_task(config: TrainConfig, model_folder: str) -> Task:
    section = config.task
    if section.name == "jsonl":
        return make_task(
            "jsonl",
            path=section.path,
            eval_path=section.eval_path,
            reward=section.reward,
            tokenizer=model_folder,
            seed=config.seed,
            max_new_tokens=config.sampling.max_new_tokens or config.engine.max_model_len // 2,
            max_model_len=config.engine.max_model_len,
            chat_template=section.chat_template,
        )
    if section.name == "arith":
        cap = config.sampling.max_new_tokens
        return make_task(
            "arith",
            tokenizer=model_folder,
            seed=config.seed,
            min_value=section.min_value,
            max_value=section.max_value,
            system_prompt=section.system_prompt,
            max_model_len=config.engine.max_model_len,
            **({"max_new_tokens": cap} if cap else {}),
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    return make_task(section.name, seed=config.seed, tokenizer=tokenizer)


def eval_versions(config: TrainConfig, start: int = 0) -> set[int]:
    """The starting version, every `eval.every`-th after it (the first row already shows the
    start), the last."""
    every = config.eval.every
    periodic = {v for v in range(start + 2, config.steps + 1) if every and v % every == 0}
    return {start, config.steps} | periodic


def run_ray(
    config: TrainConfig,
    out_dir: Path,
    *,
    pace: DeviceModel | None = None,
    defer_eval: bool = False,
    stop: StopRequest | None = None,
) -> dict[str, Any]:
    """Run to `config.steps`, or until `stop` is requested (then: the step in flight ends, a
    checkpoint of that version is written, the summary says `stopped_by`)."""
    if config.ray.address:  # a cluster that will refuse us says so before the slow part
        check_cluster_auth(config.ray.address)
    point = config.resume_point()
    model_folder = str(point.folder if point else (config.model or shipped_base_model()))
    task = build_task(config, model_folder)  # bad data stops the run before any file is written
    if stop is not None and stop.requested():
        raise KeyboardInterrupt  # asked to stop before anything started: nothing to save
    _init_ray(config)
    try:
        placed = place_actors(config)  # a cluster that cannot hold them: refused, no files
        open_run_folder(out_dir, config, resume_version=point.version if point else None)
        return _run(
            config,
            out_dir,
            model_folder,
            task,
            point,
            placed,
            pace=pace,
            defer_eval=defer_eval,
            stop=stop,
        )
    except WorkerFailed as exc:
        raise RunFailed(failure_report(exc, out_dir)) from exc
    finally:
        ray.shutdown()


def failure_report(exc: WorkerFailed, out_dir: Path) -> str:
    """Write the worker's full error to the run folder; one line on what failed and how to
    go on from the newest checkpoint."""
    details = out_dir / "failure.txt"
    details.write_text(f"{exc}\n\n{exc.detail}\n")
    try:
        newest = find_checkpoint(out_dir)
    except ConfigError:
        how = "no checkpoint yet to resume from (checkpoint_every=N writes them along the way)"
    else:
        how = f"resume from {newest.name} with: {resume_command(out_dir)}"
    return f"{exc} (full error in {details}); {how}"


def place_actors(config: TrainConfig) -> PlacedActors:
    """Reserve the actors' GPU shares on the cluster, or refuse in one line (exit 2) when it
    cannot hold them; the plan is printed when it asks for GPUs."""
    plan = config.placement(ray.cluster_resources().get("GPU", 0.0))
    if plan.uses_gpus:
        print("\n".join(f"placement: {line}" for line in plan.lines()))
    return PlacedActors(plan, timeout_s=config.ray.placement_timeout_s)


def _init_ray(config: TrainConfig) -> None:
    if config.ray.address:
        join_ray(config.ray.address)
        return
    start_local_ray(host=config.ray.host)


def _run(
    config: TrainConfig,
    out_dir: Path,
    model_folder: str,
    task: Task,
    point: ResumePoint | None,
    placed: PlacedActors,
    *,
    pace: DeviceModel | None = None,
    defer_eval: bool = False,
    stop: StopRequest | None = None,
) -> dict[str, Any]:
    controller_config = config.controller_config()
    start = controller_config.initial_version
    threads = share_threads(config.ray.threads_per_actor, config.instances)
    resume_from = str(point.folder) if point else None
    trainer_args = (model_folder, config.trainer, threads.trainer, resume_from)
    workers, trainer = start_workers(
        config.instances,
        model_folder,
        config.engine,
        trainer_args,
        threads.engine,
        pace,
        start,
        placed,
        nice=threads.engine_nice,
    )
    evaluator = _start_evaluator(config, model_folder, task, threads, placed)
    recorder = Recorder(
        out_dir,
        mode=config.mode,
        k=controller_config.effective_K,
        num_instances=config.instances,
        slots_per_instance=config.engine.max_num_seqs,
        first_version=start,
        overhead_kinds=RayRuntime.OVERHEAD_KINDS,
        texts=_texts(task) if config.record.text else None,
    )
    signal = LearningSignal()
    wanted = eval_versions(config, start)
    evals: dict[int, ray.ObjectRef] = {}
    deferred: dict[int, ray.ObjectRef | None] = {start: None}  # version -> weights, for later
    if not defer_eval:
        evals[start] = evaluator.evaluate.remote(None, start)
    scalars = ScalarLogger(out_dir, use_wandb=config.wandb, run_name=out_dir.name)

    def respawn(instance_id: int) -> Any:
        return spawn_engine(
            instance_id,
            model_folder,
            config.engine,
            threads.engine,
            pace,
            start,
            placed,
            nice=threads.engine_nice,
        )

    def respawn_trainer(checkpoint: str | None) -> Any:
        """A new trainer from `checkpoint`, or from where this run started (None)."""
        return spawn_trainer((*trainer_args[:3], checkpoint or resume_from), pace, placed)

    runtime = RayRuntime(
        controller_config,
        task,
        _rollout(config, task),
        workers,
        trainer,
        recorder,
        respawn=respawn,
        max_restarts=config.ray.max_engine_restarts,
        respawn_trainer=respawn_trainer,
        max_trainer_restarts=config.ray.max_trainer_restarts,
        checkpoints=out_dir / "checkpoints",
    )

    def on_publish(version: int) -> None:
        periodic = config.checkpoint_every and version % config.checkpoint_every == 0
        if periodic and version < config.steps:  # the last version is saved at the end
            position = runtime.controller.resume_state()
            _checkpoint(runtime, out_dir, version, position, config.checkpoint_keep)

    runtime.on_publish = on_publish
    if stop is not None:
        runtime.should_stop = stop.requested
    with TrainProgress(config.steps - start, enabled=config.progress) as progress:

        def on_step(row: dict[str, Any], groups: list) -> None:
            version = row["new_version"]
            if version in wanted and defer_eval:
                deferred[version] = runtime.weights_ref[version]
            elif version in wanted and version not in evals:
                evals[version] = evaluator.evaluate.remote(runtime.weights_ref[version], version)
            scalars.log(row)
            signal.observe(row)
            progress.update(row, _ready_accuracy(evals))

        runtime.on_step = on_step
        summary = runtime.run()
        if runtime.stopped:  # evaluations still running are not waited for
            progress.note(f"stopped: writing the checkpoint of version {runtime.published}")
            results = _ready_results(evals)
        else:
            progress.note("final evaluation and checkpoint")
            if defer_eval:
                evals = {v: evaluator.evaluate.remote(w, v) for v, w in deferred.items()}
            results = {v: ray.get(ref) for v, ref in evals.items()}
    final = runtime.controller.resume_state()  # no step in flight once the run finished
    _checkpoint(runtime, out_dir, runtime.published, final, config.checkpoint_keep, wait=True)
    rows = finish_outputs(out_dir, results, f"{config.mode} (K={controller_config.effective_K})")
    for row in rows:
        if "eval_accuracy" in row:
            scalars.log({"step": row["step"], "eval_accuracy": row["eval_accuracy"]})
    scalars.close()
    if runtime.stopped and stop is not None:
        summary = dict(summary, stopped_by=stop.name, stopped_at_version=runtime.published)
        summary["resume_command"] = resume_command(out_dir)
    return _final_summary(out_dir, summary, results, runtime)


def _texts(task: Task) -> Callable[[Sample], dict[str, str]]:
    """A sample's prompt, reference answer and response (up to its stop token) as text."""
    prompts = {p.prompt_id: p for p in task.train_prompts()}

    def texts(sample: Sample) -> dict[str, str]:
        prompt = prompts[sample.prompt_id]
        response = task.response_text(sample.response_ids)
        return {"prompt": prompt.text, "answer": prompt.answer, "response": response}

    return texts


def _start_evaluator(
    config: TrainConfig, model_folder: str, task: Task, threads: ThreadPlan, placed: PlacedActors
) -> Any:
    engine = EngineConfig(
        max_num_seqs=config.engine.max_num_seqs,
        max_model_len=config.engine.max_model_len,
        block_size=config.engine.block_size,
        device=config.engine.device,
        dtype=config.engine.dtype,
        linear_kernel=config.engine.linear_kernel,
    )
    actor = ray.remote(**actor_options("evaluator", engine.device, placed))(EvalWorker)
    return actor.remote(
        model_folder,
        engine,
        task,
        config.eval.max_prompts,
        threads.evaluator,
        threads.evaluator_nice,
    )


def _rollout(config: TrainConfig, task: Task) -> RolloutSettings:
    s = config.sampling
    return RolloutSettings(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        max_new_tokens=s.max_new_tokens or task.max_new_tokens,
        stop_token_ids=list(task.stop_token_ids),
        seed=config.seed,
        forced_lengths=config.forced_lengths.dist() if config.forced_lengths.enabled else None,
    )


def _checkpoint(
    runtime: RayRuntime,
    out_dir: Path,
    version: int,
    position: dict[str, Any],
    keep: int,
    wait: bool = False,
) -> None:
    """Queue a checkpoint of `version` on the trainer, with the data position to resume at
    (through the runtime, which replays it on a new trainer if this one dies first)."""
    assert position["version"] == version, f"data position of v{position['version']} for v{version}"
    folder = out_dir / "checkpoints" / f"version_{version:05d}"
    ref = runtime.save_checkpoint(folder, position, keep)
    if wait:
        ray.get(ref)


def _ready_results(evals: dict[int, ray.ObjectRef]) -> dict[int, dict[str, Any]]:
    ready, _ = (
        ray.wait(list(evals.values()), num_returns=len(evals), timeout=0) if evals else ([], [])
    )
    return {v: ray.get(ref) for v, ref in evals.items() if ref in ready}


def _ready_accuracy(evals: dict[int, ray.ObjectRef]) -> dict[int, float]:
    if not evals:
        return {}
    ready, _ = ray.wait(list(evals.values()), num_returns=len(evals), timeout=0)
    done = {ref: v for v, ref in evals.items() if ref in ready}
    return {done[ref]: ray.get(ref)["accuracy"] for ref in ready}


def _final_summary(
    out_dir: Path, summary: dict[str, Any], evals: dict[int, dict[str, Any]], runtime: RayRuntime
) -> dict[str, Any]:
    ordered = [evals[v] for v in sorted(evals)]
    summary = dict(summary)
    summary["reward_errors"] = runtime.reward_errors
    summary["eval"] = {str(r["version"]): r["accuracy"] for r in ordered}
    if ordered:  # a stopped run may have none finished
        summary["eval_accuracy_first"] = ordered[0]["accuracy"]
        summary["eval_accuracy_last"] = ordered[-1]["accuracy"]
    if runtime.pace_total["engine"].steps or runtime.pace_total["train"].steps:
        summary["pace"] = {kind: stats.to_dict() for kind, stats in runtime.pace_total.items()}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
