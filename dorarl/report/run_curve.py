"""A run folder's learning curve: reward per step and held-out accuracy per evaluated version.

Both plots of a run (its reward_curve.png, `dorarl report compare`'s PNG) draw this curve,
on one x axis: a step's reward at the version it made, an evaluation at the version it is
of (the start, v0 or the version a run resumed from, at 0). Times are on the run's clock: a resumed run's segments end to end
(dorarl.record.segments), where each metrics row's own `time_s` starts again at its
segment's start.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dorarl.record.evaluations import read_evaluations, row_evaluations, sampled_scores
from dorarl.record.segments import read_segments, run_times
from dorarl.run_layout import RunFolder


@dataclass
class History:
    """The steps a run folder keeps (a resumed run's kept steps, in order), each one's time
    on the run's clock, and its evaluations by version."""

    rows: list[dict[str, Any]]
    times: list[float]
    evals: dict[int, dict[str, Any]]


def read_history(run_dir: Path) -> History:
    """The run folder's metrics rows with its evaluations.jsonl (or, in a run folder written
    before that file, the evaluations its metrics rows carry)."""
    run = RunFolder(run_dir)
    rows = [json.loads(line) for line in run.metrics.read_text().splitlines() if line.strip()]
    evals = row_evaluations(rows) | read_evaluations(run.evaluations)
    segments = read_segments(run_dir, rows)
    if segments:  # a run folder of dorarl train; the simulator's has one clock
        rows = [r for s in segments for r in s.rows]
        times = run_times(segments)
    else:
        times = [r["time_s"] for r in rows]
    return History(rows, times, evals)


def read_curve(run_dir: Path) -> dict[str, Any]:
    """The curve of the history the run folder keeps."""
    history = read_history(run_dir)
    return curve_of(history.rows, history.times, history.evals)


def curve_of(
    rows: list[dict[str, Any]], times: list[float], evals: dict[int, dict[str, Any]]
) -> dict[str, Any]:
    """Per step (metrics rows, `times` on the run's clock): the version it made, its reward;
    per evaluated version (`evals`, of the versions the history made): its scores and the
    time it was made."""
    # a run resumed into a new folder starts later; each step makes the next version
    start = rows[0]["new_version"] - 1 if rows else 0
    made_at = {start: 0.0} | {r["new_version"]: t for r, t in zip(rows, times, strict=True)}
    kept = sorted((v, _scores(e)) for v, e in evals.items() if v in made_at)
    return {
        "steps": [r["new_version"] for r in rows],
        "time_s": times,
        "reward_mean": [r["reward_mean"] for r in rows],
        "eval": [{"version": v, "time_s": made_at[v], **scores} for v, scores in kept],
        "wall_time_s": times[-1] if times else 0.0,
    }


def _scores(result: dict[str, Any]) -> dict[str, float]:
    """An evaluation's greedy `accuracy`, and mean@k and pass@j when it sampled; `n`, the
    held-out prompts it scored, where recorded."""
    n = {"n": int(result["n"])} if result.get("n") is not None else {}
    return {"accuracy": result["accuracy"], **sampled_scores(result), **n}
