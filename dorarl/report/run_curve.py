"""A run folder's learning curve: reward per step and held-out accuracy per evaluated version.

Times are on the run's clock: a resumed run's segments end to end (dorarl.record.segments),
where each metrics row's own `time_s` starts again at its segment's start.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dorarl.record.segments import read_segments, run_times


def read_curve(run_dir: Path) -> dict[str, Any]:
    """Per step: reward and time; per evaluated version: accuracy and the time it was made."""
    rows = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    segments = read_segments(run_dir, rows)
    if segments:  # a run folder of dorarl train; the simulator's has one clock
        rows = [r for s in segments for r in s.rows]
        times = run_times(segments)
    else:
        times = [r["time_s"] for r in rows]
    made_at = {0: 0.0} | {r["new_version"]: t for r, t in zip(rows, times, strict=True)}
    evals = sorted(
        {r["eval_version"]: r["eval_accuracy"] for r in rows if "eval_version" in r}.items()
    )
    return {
        "steps": [r["step"] + 1 for r in rows],
        "time_s": times,
        "reward_mean": [r["reward_mean"] for r in rows],
        "eval": [{"version": v, "time_s": made_at[v], "accuracy": a} for v, a in evals],
        "wall_time_s": times[-1] if times else 0.0,
    }
