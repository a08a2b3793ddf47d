"""Per-mode benchmark figures from a run's step rows, the workload's length stats, the bars.

Figures cover the measured steps: every step after the first `warmup` (the pipeline fill of
the asynchronous modes is not their steady state). A step row is a metrics.jsonl line of
the recorder, with the runtime's `pace_engine` / `pace_train` when paced.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from dorarl.runtime.pacing import PaceStats
from dorarl.runtime.recorder import OVERHEAD_KINDS


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


def _staleness(rows: Iterable[dict[str, Any]]) -> dict[str, int]:
    total: Counter = Counter()
    for r in rows:
        total.update({int(s): n for s, n in r["staleness"].items()})
    return {str(s): total[s] for s in sorted(total)}


def _overheads(rows: Sequence[dict[str, Any]], wall: float, num_instances: int) -> dict:
    """Instance-seconds of each overhead over instance-seconds of the measured steps."""
    shares = {
        kind: _share(sum(r["overhead_s"][kind] for r in rows), wall * num_instances)
        for kind in OVERHEAD_KINDS
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


# ---- workload ----------------------------------------------------------------------------
def length_stats(lengths: Sequence[int]) -> dict[str, float]:
    arr = np.asarray(lengths, dtype=float)
    median, p99 = float(np.median(arr)), float(np.percentile(arr, 99))
    return {
        "n": int(arr.size),
        "median": median,
        "mean": float(arr.mean()),
        "p90": float(np.percentile(arr, 90)),
        "p99": p99,
        "max": float(arr.max()),
        "p99_over_median": p99 / median if median else 0.0,
    }


def makespan_steps(lengths: Sequence[int], slots: int) -> int:
    """Engine steps to run `lengths` in dispatch order on `slots` slots (a sync rollout)."""
    free = [0] * slots
    for n in lengths:
        i = min(range(slots), key=free.__getitem__)
        free[i] += n
    return max(free)


# ---- bars --------------------------------------------------------------------------------
def check_bars(results: dict[str, dict], dora: str) -> list[dict[str, Any]]:
    """The benchmark's bars for the dora run named `dora`, each with its figure."""
    tps = {m: r["consumed_tokens_per_s"] for m, r in results.items()}
    bars = [
        _bar(f"{dora} tokens/s / sync", _share(tps[dora], tps["sync"]), ">=", 2.0),
        _bar(f"{dora} tokens/s / one_step_off", _share(tps[dora], tps["one_step_off"]), ">=", 1.3),
        _bar(
            f"{dora} tokens/s / partial_rollout",
            _share(tps[dora], tps["partial_rollout"]),
            ">=",
            1.15,
        ),
        _bar(f"{dora} rollout-only share", results[dora]["rollout_only_share"], "<=", 0.15),
        _bar("sync rollout-only share", results["sync"]["rollout_only_share"], ">=", 0.5),
        _bar(f"{dora} overhead share", results[dora]["overhead_share"]["total"], "<=", 0.05),
    ]
    return bars


def _bar(name: str, value: float, op: str, target: float) -> dict[str, Any]:
    met = value >= target if op == ">=" else value <= target
    return {"bar": name, "value": value, "target": f"{op} {target}", "met": met}
