"""A run folder's learning curve: reward per step and held-out accuracy per evaluated version."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_curve(run_dir: Path) -> dict[str, Any]:
    """Per step: reward and time; per evaluated version: accuracy and the time it was made."""
    rows = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    made_at = {0: 0.0} | {r["new_version"]: r["time_s"] for r in rows}
    evals = sorted(
        {r["eval_version"]: r["eval_accuracy"] for r in rows if "eval_version" in r}.items()
    )
    return {
        "steps": [r["step"] + 1 for r in rows],
        "time_s": [r["time_s"] for r in rows],
        "reward_mean": [r["reward_mean"] for r in rows],
        "eval": [{"version": v, "time_s": made_at[v], "accuracy": a} for v, a in evals],
        "wall_time_s": rows[-1]["time_s"] if rows else 0.0,
    }
