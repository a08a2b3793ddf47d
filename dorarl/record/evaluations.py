"""A run's held-out evaluations: one row each in evaluations.jsonl, appended as it finishes
(version, accuracy, mean@k and pass@j when it sampled, its time); readers join them to the
metrics rows by version. Run folders written before the file existed carry them in their
metrics rows (`eval_*` keys): `row_evaluations` reads those."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

SAMPLED = ("mean@", "pass@")
"""An evaluation's scores of sampled responses (eval.samples = k > 0) beside greedy accuracy."""


def sampled_scores(result: dict[str, Any]) -> dict[str, float]:
    """An evaluation's mean@k and pass@j (present with eval.samples = k > 0)."""
    return {k: v for k, v in result.items() if k.startswith(SAMPLED)}


def held_out_count(results: list[dict[str, Any]]) -> int | None:
    """How many held-out prompts the newest of `results` scored (None: none says, as in
    run folders whose evaluations did not record it)."""
    counts = [int(r["n"]) for r in results if r.get("n") is not None]
    return counts[-1] if counts else None


def sampled_eval_summary(ordered: list[dict[str, Any]]) -> dict[str, Any]:
    """summary.json's sampled scores, {"eval_sampled": {version: {"mean@k": .., ..}}}, when
    the evaluations sampled (eval.samples > 0); nothing otherwise."""
    sampled = {str(r["version"]): sampled_scores(r) for r in ordered if sampled_scores(r)}
    return {"eval_sampled": sampled} if sampled else {}


def append_evaluation(path: Path, result: dict[str, Any]) -> dict[str, Any]:
    """Append `result` (an evaluator's answer: version, accuracy, ...) as one row, with the
    time it was recorded (seconds since the epoch); returns the row."""
    row = dict(result) | {"finished_at": time.time()}
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def read_evaluations(path: Path) -> dict[int, dict[str, Any]]:
    """The evaluations in `path` by version, in version order; of two rows of one version
    the later wins (a run resumed from version V evaluates V again)."""
    if not path.is_file():
        return {}
    found: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            found[int(row["version"])] = row
    return dict(sorted(found.items()))


def row_evaluations(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The evaluations an older run folder's metrics rows carry (`eval_version`,
    `eval_accuracy`, `eval_mean@k`, `eval_pass@j`), by version."""
    found: dict[int, dict[str, Any]] = {}
    for row in rows:
        if "eval_version" in row:
            scores = {k.removeprefix("eval_"): v for k, v in row.items()
                      if k.startswith(tuple(f"eval_{p}" for p in SAMPLED))}  # fmt: skip
            version = int(row["eval_version"])
            found[version] = {"version": version, "accuracy": row["eval_accuracy"], **scores}
    return dict(sorted(found.items()))
