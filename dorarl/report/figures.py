"""Per-mode figures from a run's step rows (metrics.jsonl lines), for benchmarks and simulations.

Figures cover the measured steps: every step after the first `warmup` (the pipeline fill of
the asynchronous modes is not their steady state). A step row is a metrics.jsonl line of
the recorder, with the runtime's `pace_engine` / `pace_train` when paced. A mode whose
measured steps went over their pace more often than `OVER_PACE_LIMITS` allows was not held
to the device model (the CPU was short), and every benchmark bar that uses it says so.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from dorarl.record.pacing import PaceStats
from dorarl.record.recorder import OVERHEAD_KINDS

OVER_PACE_LIMITS = {"engine": 0.05, "train": 0.10}
"""Largest share of measured steps over their pace for a mode's figures to count as paced."""


def mode_figures(rows: Sequence[dict[str, Any]], warmup: int, num_instances: int) -> dict:
    """The modes.json entry of one mode (measured steps only, `all_steps` for the whole run)."""
    measured = list(rows[warmup:])
    if not measured:
        raise ValueError(f"no measured steps: {len(rows)} steps with {warmup} warm-up steps")
    wall = sum(r["step_time_s"] for r in measured)
    times = [r["step_time_s"] for r in measured]
    return {
        "measured_steps": len(measured),
        "warmup_steps": warmup,
        "step_time_s": {"mean": statistics.mean(times), "median": statistics.median(times)},
        "rollout_only_share": _share(sum(r["rollout_only_s"] for r in measured), wall),
        "train_time_s": statistics.mean(r["train_time_s"] for r in measured),
        "consumed_tokens": sum(r["consumed_tokens"] for r in measured),
        "consumed_tokens_per_s": _share(sum(r["consumed_tokens"] for r in measured), wall),
        "slot_utilization": _share(
            sum(r["slot_utilization"] * r["step_time_s"] for r in measured), wall
        ),
        "staleness": _staleness(measured),
        "overhead_share": _overheads(measured, wall, num_instances),
        "reprefill_tokens": sum(r["reprefill_tokens"] for r in measured),
        "migrations": sum(r["migrations"] for r in measured),
        "pace": _pace(measured),
        "per_step": {  # the measured steps in order (what a staleness ceiling is built on)
            "rollout_only_s": [r["rollout_only_s"] for r in measured],
            "train_time_s": [r["train_time_s"] for r in measured],
        },
        "all_steps": {
            "steps": len(rows),
            "wall_s": sum(r["step_time_s"] for r in rows),
            "consumed_tokens_per_s": _share(
                sum(r["consumed_tokens"] for r in rows), sum(r["step_time_s"] for r in rows)
            ),
            "staleness": _staleness(rows),
            "reprefill_tokens": sum(r["reprefill_tokens"] for r in rows),
            "migrations": sum(r["migrations"] for r in rows),
            "pace": _pace(rows),
        },
    }


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0


def paced_reliably(figure: dict[str, Any]) -> bool:
    """Whether real compute stayed within the pace often enough (see OVER_PACE_LIMITS)."""
    pace = figure["pace"]
    return all(pace[kind]["over_share"] <= limit for kind, limit in OVER_PACE_LIMITS.items())


def _staleness(rows: Iterable[dict[str, Any]]) -> dict[str, int]:
    total: Counter = Counter()
    for r in rows:
        total.update({int(s): n for s, n in r["staleness"].items()})
    return {str(s): total[s] for s in sorted(total)}


def _overheads(rows: Sequence[dict[str, Any]], wall: float, num_instances: int) -> dict:
    """Instance-seconds of each overhead over instance-seconds of the measured steps; only
    the kinds the run measured (the Ray runtime has no free_cache)."""
    kinds = [k for k in OVERHEAD_KINDS if k in rows[0]["overhead_s"]]
    shares = {
        kind: _share(sum(r["overhead_s"][kind] for r in rows), wall * num_instances)
        for kind in kinds
    }
    return shares | {"total": sum(shares.values())}


def _pace(rows: Iterable[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Real compute against device time, engines and trainer, summed over the steps."""
    out = {}
    for kind in ("engine", "train"):
        stats = PaceStats()
        for r in rows:
            if f"pace_{kind}" in r:
                stats.merge(PaceStats(**_fields(r[f"pace_{kind}"])))
        out[kind] = stats.to_dict()
    return out


def _fields(values: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in values.items() if k != "over_share"}
