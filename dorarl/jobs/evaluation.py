"""Held-out evaluation of a training run: which versions, and how a result joins the steps.

The base (or resumed) version, every `eval.every`-th after it and the last are evaluated;
each result is a row of evaluations.jsonl (dorarl.record.evaluations) as it finishes. A
result joins the metrics row of the step that made its version (the first row carries the
start's): TensorBoard shows it at that step. At the end the reward curve is drawn.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dorarl.jobs.config import TrainConfig
from dorarl.record.evaluations import read_evaluations, row_evaluations, sampled_scores
from dorarl.report.run_curve import read_curve
from dorarl.run_layout import RunFolder


def eval_versions(config: TrainConfig, start: int = 0) -> set[int]:
    """The starting version, every `eval.every`-th after it (the first row already shows the
    start), the last; none with `eval.every=off`."""
    every = config.eval.every
    if every == "off":
        return set()
    periodic = {v for v in range(start + 2, config.steps + 1) if every and v % every == 0}
    return {start, config.steps} | periodic


def finish_outputs(out_dir: Path, evals: dict[int, dict[str, Any]], title: str) -> list[dict]:
    """Draw the reward curve of the run's metrics and evaluations files; returns the
    TensorBoard rows of `evals` (this segment's evaluations) at the steps they join."""
    run = RunFolder(out_dir)
    rows = _rows(run.metrics)
    if not rows:  # stopped before its first step
        return []
    from dorarl.report.plots import plot_training_curve  # matplotlib: only once a run ends

    plot_training_curve(read_curve(out_dir), run.reward_curve, title=title)
    return eval_scalars(rows, evals)


def eval_scalars(
    rows: list[dict[str, Any]], evals: dict[int, dict[str, Any]]
) -> list[dict[str, Any]]:
    """The TensorBoard rows of `evals`: each one's scalars at the step of the metrics row
    (of `rows`, the run's history) it joins."""
    scalars = []
    for row in rows:
        joined = dict(row)
        if _attach_eval(joined, evals, first_step=rows[0]["step"]) is not None:
            scalars.append({"step": row["step"], **eval_fields(joined)})
    return scalars


def with_evaluations(out_dir: Path) -> list[dict[str, Any]]:
    """The run's metrics rows, each with the evaluation it joins (`eval_*` keys), as a
    reader of one table wants them; older run folders' rows carry theirs already."""
    run = RunFolder(out_dir)
    rows = _rows(run.metrics)
    evals = row_evaluations(rows) | read_evaluations(run.evaluations)
    for row in rows:
        _attach_eval(row, evals, first_step=rows[0]["step"])
    return rows


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _attach_eval(
    row: dict[str, Any], evals: dict[int, dict[str, Any]], first_step: int
) -> int | None:
    """The first row carries the evaluation of the version it started from (the base model,
    or a resumed checkpoint); other rows that of the version they made. Returns the version
    attached (None: none of `evals` is the row's)."""
    start = row["step"] == first_step and row.get("version") in evals
    version = row["version"] if start else row.get("new_version")
    result = evals.get(version)
    if result is not None:
        row["eval_accuracy"] = result["accuracy"]
        row.update({f"eval_{key}": value for key, value in sampled_scores(result).items()})
        row["eval_version"] = version
        return version
    return None


def eval_fields(row: dict[str, Any]) -> dict[str, float]:
    """A metrics row's evaluation scalars: greedy accuracy, mean@k and pass@j."""
    keys = ("eval_accuracy", "eval_mean@", "eval_pass@")
    return {k: v for k, v in row.items() if k.startswith(keys)}


def headline_scores(result: dict[str, Any]) -> dict[str, float]:
    """Of an evaluation's sampled scores, the two a line has room for: mean@k and pass@k
    (k = eval.samples); nothing for a greedy-only one."""
    means = [key for key in result if key.startswith("mean@")]
    if not means:
        return {}
    k = means[0].removeprefix("mean@")
    return {key: result[key] for key in (f"mean@{k}", f"pass@{k}") if key in result}


def format_scores(result: dict[str, Any]) -> str:
    """'0.500' greedy only; '0.500 mean@4 0.375 pass@4 0.750' when it sampled; chat
    episodes add the share that called a tool ('0.500 tool use 0.620')."""
    scores = "".join(f" {key} {value:.3f}" for key, value in headline_scores(result).items())
    tools = f" tool use {result['tool_use']:.3f}" if result.get("tool_use") is not None else ""
    return f"{result['accuracy']:.3f}{scores}{tools}"


def version_label(version: int, result: dict[str, Any]) -> str:
    """An evaluation's version and the held-out prompts its scores are shares of, where the
    result says: 'v8 (n=3)', else 'v8'."""
    n = result.get("n")
    return f"v{version}" + ("" if n is None else f" (n={int(n)})")


SMALL_HELD_OUT = 50
"""Held-out prompts under which an accuracy is too coarse to compare (steps of 2% and up)."""


def held_out_line(config: TrainConfig, available: int) -> tuple[str, str | None]:
    """The start's line on the held-out set (`available`: the task's held-out prompts, of
    which `eval.max_prompts` are scored) and, under SMALL_HELD_OUT, a warning saying how to
    have more."""
    n = min(available, config.eval.max_prompts)
    task = config.task
    if task.name == "jsonl":
        source = f"from {task.eval_path}" if task.eval_path else f"split off {task.path}"
    else:
        source = f"drawn by task {task.name}"
    line = f"held-out: {n} prompts ({source})"
    if n >= SMALL_HELD_OUT:
        return line, None
    if config.eval.max_prompts < available:
        more = "raise eval.max_prompts"
    elif task.name == "jsonl":
        more = "give a held-out file of 50 rows or more with task.eval_path=FILE"
    elif task.name in ("arith", "calculator"):
        more = "a wider task.min_value..task.max_value range has more distinct problems"
    else:
        more = f"task {task.name} has no more"
    step = 1 / max(n, 1)
    warning = (
        f"held-out: only {n} prompts, so an accuracy moves in steps of {step:.2g} and its "
        f"standard error is up to {0.5 * step**0.5:.2g}; {more}"
    )
    return line, warning
