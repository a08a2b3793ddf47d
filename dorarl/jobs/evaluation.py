"""Held-out evaluation of a training run: which versions, and their rows in metrics.jsonl.

The base (or resumed) version, every `eval.every`-th after it and the last are evaluated;
at the end each result joins the metrics row of the step that made its version (the first
row carries the start's), and the reward curve is drawn.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dorarl.jobs.config import TrainConfig
from dorarl.report.run_curve import read_curve


def eval_versions(config: TrainConfig, start: int = 0) -> set[int]:
    """The starting version, every `eval.every`-th after it (the first row already shows the
    start), the last."""
    every = config.eval.every
    periodic = {v for v in range(start + 2, config.steps + 1) if every and v % every == 0}
    return {start, config.steps} | periodic


def finish_outputs(out_dir: Path, evals: dict[int, dict[str, Any]], title: str) -> list[dict]:
    """Merge evaluations into metrics.jsonl, then draw the curve and fill TensorBoard."""
    path = out_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:  # stopped before its first step
        return rows
    for row in rows:
        _attach_eval(row, evals, first_step=rows[0]["step"])
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    from dorarl.report.plots import plot_training_curve  # matplotlib: only once a run ends

    plot_training_curve(read_curve(out_dir), out_dir / "reward_curve.png", title=title)
    return rows


def _attach_eval(row: dict[str, Any], evals: dict[int, dict[str, Any]], first_step: int) -> None:
    """The first row carries the evaluation of the version it started from (the base model,
    or a resumed checkpoint); other rows that of the version they made."""
    start = row["step"] == first_step and row.get("version") in evals
    version = row["version"] if start else row.get("new_version")
    result = evals.get(version)
    if result is not None:
        row["eval_accuracy"] = result["accuracy"]
        row.update({f"eval_{key}": value for key, value in sampled_scores(result).items()})
        row["eval_version"] = version


def sampled_scores(result: dict[str, Any]) -> dict[str, float]:
    """An evaluation's mean@k and pass@j (present with eval.samples = k > 0)."""
    return {k: v for k, v in result.items() if k.startswith(("mean@", "pass@"))}


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
    """'0.500' greedy only; '0.500 mean@4 0.375 pass@4 0.750' when it sampled."""
    scores = "".join(f" {key} {value:.3f}" for key, value in headline_scores(result).items())
    return f"{result['accuracy']:.3f}{scores}"


def sampled_eval_summary(ordered: list[dict[str, Any]]) -> dict[str, Any]:
    """summary.json's sampled scores, {"eval_sampled": {version: {"mean@k": .., ..}}}, when
    the evaluations sampled (eval.samples > 0); nothing otherwise."""
    sampled = {str(r["version"]): sampled_scores(r) for r in ordered if sampled_scores(r)}
    return {"eval_sampled": sampled} if sampled else {}
