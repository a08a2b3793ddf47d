"""Per-mode benchmark figures from a run's step rows, the workload's length stats, the bars.

Figures cover the measured steps: every step after the first `warmup` (the pipeline fill of
the asynchronous modes is not their steady state). A step row is a metrics.jsonl line of
the recorder, with the runtime's `pace_engine` / `pace_train` when paced. A mode whose
measured steps went over their pace more often than `OVER_PACE_LIMITS` allows was not held
to the device model (the CPU was short), and every bar that uses it says so.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from dorarl.runtime.pacing import PaceStats
from dorarl.runtime.recorder import OVERHEAD_KINDS

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
def staleness_ceiling(k: int, rollout_s: float, train_s: float) -> tuple[float, float]:
    """(most step-rate speedup over sync, least rollout-only share) any schedule with bound K
    can reach, when a batch's slowest group takes the sync rollout time R and a training step
    takes T.

    A group of version t is dispatched no earlier than t is published (the end of training
    step t-1) and must be consumed by step t+K, so step t+K starts at least T + R after step
    t-1 does: in steady state a step every P >= max(T, (R + T) / (K + 1)). Sync takes R + T.
    """
    period = max(train_s, (rollout_s + train_s) / (k + 1))
    return _share(rollout_s + train_s, period), _share(period - train_s, period)


def check_bars(results: dict[str, dict], dora: str) -> list[dict[str, Any]]:
    """The benchmark's bars for the dora run named `dora`, each with its figure and the
    ceiling the run's staleness bound puts on it (`staleness_ceiling`, from the sync run)."""
    tps = {m: r["consumed_tokens_per_s"] for m, r in results.items()}
    sync = results["sync"]
    rollout = sync["rollout_only_share"] * sync["step_time_s"]["mean"]
    k = int(results[dora].get("K", dora.rsplit("_k", 1)[-1]))
    most_speedup, least_share = staleness_ceiling(k, rollout, sync["step_time_s"]["mean"] - rollout)

    def bar(name: str, modes: tuple[str, ...], value: float, op: str, target: float,
            bound: float | None = None) -> dict:  # fmt: skip
        met = value >= target if op == ">=" else value <= target
        paced = all(paced_reliably(results[m]) for m in modes)
        return {"bar": name, "value": value, "target": f"{op} {target}", "met": met,
                "modes": list(modes), "paced_reliably": paced, "k_bound": bound}  # fmt: skip

    def speedup(other: str, target: float) -> dict:
        value = _share(tps[dora], tps[other])
        bound = most_speedup * _share(tps["sync"], tps[other])
        return bar(f"{dora} tokens/s / {other}", (dora, other), value, ">=", target, bound)

    return [
        speedup("sync", 2.0),
        speedup("one_step_off", 1.3),
        speedup("partial_rollout", 1.15),
        bar(
            f"{dora} rollout-only share",
            (dora,),
            results[dora]["rollout_only_share"],
            "<=",
            0.15,
            least_share,
        ),  # fmt: skip
        bar("sync rollout-only share", ("sync",), sync["rollout_only_share"], ">=", 0.5),
        bar(
            f"{dora} overhead share", (dora,), results[dora]["overhead_share"]["total"], "<=", 0.05
        ),
    ]
