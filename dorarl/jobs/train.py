"""`dorarl train`: load and validate the config, read the checkpoint `resume=` names (once,
for the whole run), start the runtime, write the run folder.

Usage: dorarl train [--config FILE] [--out DIR] [key=value ...]; `--help` lists every key
(and imports no torch, Ray or transformers, so it answers at once). The run folder
(dorarl.run_layout) holds config.json, metrics.jsonl, trajectories.jsonl, evaluations.jsonl,
summary.json, trace.json, reward_curve.png, tensorboard/, checkpoints/ and segments/ (each
process's own summary and trace; summary.json and trace.json are the whole run's). Ctrl-C
stops a run cleanly; `resume=RUN_DIR` continues it.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dorarl.config import ConfigError, describe, to_yaml
from dorarl.jobs.config import TrainConfig
from dorarl.jobs.resume import ResumePoint, check_work_left, read_resume_point
from dorarl.jobs.run_folder import choose_out, load_run_config, open_run_folder, resume_command
from dorarl.runtime.placement import plan_placement

log = logging.getLogger(__name__)


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(_help())
        return 0
    args = _parse_args(argv)
    config = load_run_config(args.config, args.overrides)
    point = resume_point(config)
    if args.print_config:
        print(printed_config(config, point), end="")
        return 0
    if args.print_placement is not None:
        print("\n".join(_placement_lines(config, point, args.print_placement)))
        return 0
    out_dir = choose_out(args.out, config.resume, config.mode)
    _setup_logging()
    if config.runtime == "sim":
        from dorarl.jobs.sim_run import run_sim

        open_run_folder(out_dir, config, resume_version=None)
        summary = run_sim(config, out_dir)
        _print_summary(summary, out_dir)
        return 0 if summary.get("dropped_total", 0) == 0 else 1
    return _train_on_ray(config, point, out_dir)


def resume_point(config: TrainConfig) -> ResumePoint | None:
    """The checkpoint `resume=` names, read here once for the whole run (None: a fresh run);
    RunComplete when it already holds the version the run ends at."""
    if not config.resume:
        return None
    point = read_resume_point(config.resume)
    check_work_left(point, config.steps)
    return point


def printed_config(config: TrainConfig, point: ResumePoint | None) -> str:
    """The settings as YAML, once every check a run makes before it starts has passed
    (`dorarl.jobs.preflight`: each problem one line, exit 2); a setting left to the model
    says what it comes to for this one."""
    if config.runtime != "ray":
        return to_yaml(config)
    from dorarl.jobs.engine_plan import model_folder
    from dorarl.jobs.model_defaults import LORA_RATE_FACTOR, default_lr, rate
    from dorarl.jobs.preflight import check_run

    check_run(config, point)
    folder = model_folder(config, point)
    notes = {}
    if config.trainer.lr is None:
        chosen = default_lr(folder, point, config.engine.backend)
        notes["trainer.lr"] = f"by the model: {rate(chosen.value)} here ({chosen.why})"
        lora = config.trainer.lora
        if lora.enabled and lora.lr is None:
            adapters = rate(LORA_RATE_FACTOR * chosen.value)
            notes["trainer.lora.lr"] = f"by the model: {adapters} here ({LORA_RATE_FACTOR}x lr)"
    return to_yaml(config, notes)


def _train_on_ray(config: TrainConfig, point: ResumePoint | None, out_dir: Path) -> int:
    """Run on Ray; SIGINT/SIGTERM stop it after the step in flight (exit 128 + signal), a
    second one aborts at once (exit 130); either way one line says how to resume."""
    from dorarl.jobs.ray_run import run_ray
    from dorarl.jobs.startup import since_process_start
    from dorarl.jobs.stopping import StopRequest

    imports_s = since_process_start()
    try:
        with StopRequest() as stop:
            summary = run_ray(config, point, out_dir, stop=stop, imports_s=imports_s)
    except KeyboardInterrupt:
        print(f"dorarl: aborted; {_how_to_resume(out_dir)}", file=sys.stderr)
        return 130
    _print_summary(summary, out_dir)
    if stop.requested():
        version = summary.get("stopped_at_version")
        if "resume_command" in summary:
            print(f"stopped by {stop.name} at version {version}; continue the run with:")
            print(f"  {summary['resume_command']}")
        else:  # checkpoint_every=off: nothing to continue from
            print(f"stopped by {stop.name} at version {version}; {_how_to_resume(out_dir)}")
        return stop.exit_code
    return 0 if summary.get("dropped_total", 0) == 0 else 1


def _placement_lines(config: TrainConfig, point: ResumePoint | None, gpus: float) -> list[str]:
    """The GPU shares on a node of `gpus` GPUs and each engine's KV budget in its share."""
    plan = plan_placement(config.instances, config.engine, config.trainer, config.ray, gpus)
    if not plan.uses_gpus:
        return plan.lines()
    from dorarl.jobs.engine_plan import model_folder as folder_of
    from dorarl.jobs.engine_plan import model_spec
    from dorarl.runtime.engine_budget import budget_lines, engine_budgets, gpu_memory

    spec, _ = model_spec(folder_of(config, point), config.engine.backend)
    gpu_bytes = gpu_memory(config.ray)
    budgets = engine_budgets(config.instances, config.engine, spec, plan.shares, gpu_bytes)
    return plan.lines() + budget_lines(budgets, gpu_bytes)


def _how_to_resume(out_dir: Path) -> str:
    from dorarl.jobs.resume import find_checkpoint

    try:
        newest = find_checkpoint(out_dir)
    except ConfigError:
        return f"no checkpoint in {out_dir} to resume from"
    return f"resume from {newest.name} with: {resume_command(out_dir)}"


def _setup_logging() -> None:
    """Warnings go through rich, so they print above the live progress bar, not into it."""
    from rich.logging import RichHandler

    handler = RichHandler(show_time=False, show_path=False, markup=False)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s", handlers=[handler])
    logging.captureWarnings(True)  # warnings.warn, too, prints through the progress console


@dataclass
class TrainArgs:
    config: str | None = None
    out: str | None = None
    print_config: bool = False
    print_placement: float | None = None  # GPUs of the node to plan for
    overrides: list[str] = field(default_factory=list)


def _parse_args(argv: list[str]) -> TrainArgs:
    parsed = TrainArgs()
    args = iter(argv)
    for arg in args:
        if arg in ("--config", "--out", "--print-placement"):
            value = next(args, None)
            if value is None:
                raise ConfigError(f"{arg} needs a value")
            if arg == "--print-placement":
                parsed.print_placement = _gpu_count(value)
            else:
                setattr(parsed, arg.removeprefix("--"), value)
        elif arg == "--print-config":
            parsed.print_config = True
        elif arg.startswith("--"):
            raise ConfigError(f"unknown option {arg} (use key=value for settings)")
        else:
            parsed.overrides.append(arg)
    return parsed


def _gpu_count(text: str) -> float:
    try:
        gpus = float(text)
    except ValueError:
        gpus = -1.0
    if gpus < 0:
        raise ConfigError(f"--print-placement: expected the node's GPU count, got {text!r}")
    return gpus


def _help() -> str:
    rows = describe(TrainConfig)
    width = max(len(key) for key, _, _ in rows)
    lines = [
        "usage: dorarl train [--config FILE] [--out DIR] [key=value ...]",
        "       dorarl train --print-config [--config FILE] [key=value ...]",
        "       dorarl train --print-placement GPUS [--config FILE] [key=value ...]",
        "",
        "--print-config makes every check a run makes before it starts (model folder,",
        "tokenizer, data rows against engine.max_model_len, env, agent, reward), prints each",
        "problem on a line (exit 2), else the resolved settings as YAML (--config reads them);",
        "--print-placement prints the GPU shares the actors would ask for on a node with",
        "GPUS GPUs, and each engine's KV budget in its share (of ray.gpu_memory_gb, else",
        "of this machine's GPU). Neither starts anything.",
        "",
        "Runs RL training (default: the built-in running_sum task, dora mode, local Ray,",
        "the shipped base model). Ctrl-C stops after the step in flight with a checkpoint;",
        "`dorarl train resume=RUN_DIR` continues that run (its config.json, its folder).",
        "Settings, as key=value or in a YAML file:",
        "",
    ]
    lines += [f"  {key:<{width}}  {default:<14} {help_}" for key, default, help_ in rows]
    return "\n".join(lines)


def _print_summary(summary: dict[str, Any], out_dir: Path) -> None:
    from rich.table import Table

    from dorarl.report.console import table_console

    title = f"dorarl train: {summary.get('mode')} (K={summary.get('K')})"
    segments = len(summary.get("segments", []))
    if segments > 1:
        title += f", the whole run: {segments} segments"
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in (
        "steps",
        "dispatched",
        "completed",
        "consumed",
        "filtered",
        "in_flight_at_end",
        "queued_at_end",
        "dropped_total",
        "wall_time_s",
        "throughput_tokens_per_s",
        "mean_step_time_s",
        "rollout_only_share",
        "migrations",
    ):
        if key in summary:
            table.add_row(key, _cell(summary[key]))
    if "startup" in summary:
        table.add_row("startup_to_first_step_s", _cell(summary["startup"]["total_s"]))
    for key, value in _eval_rows(summary):
        table.add_row(key, _cell(value))
    console = table_console()
    console.print(table)
    console.print(f"run folder: {out_dir}")


def _cell(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _eval_rows(summary: dict[str, Any]) -> list[tuple[str, Any]]:
    """The first evaluation and the last (when later): version, greedy accuracy, and the
    mean@k and pass@j of one that sampled (eval.samples > 0)."""
    sampled = summary.get("eval_sampled", {})
    rows: list[tuple[str, Any]] = []
    for end in ("first", "last"):
        version = summary.get(f"eval_version_{end}")
        if version is None:
            continue
        rows += [(f"eval_version_{end}", version)]
        rows += [(f"eval_accuracy_{end}", summary[f"eval_accuracy_{end}"])]
        rows += [(f"eval_{key}_{end}", v) for key, v in sampled.get(str(version), {}).items()]
    return rows + ([("eval_n", summary["eval_n"])] if rows and "eval_n" in summary else [])
