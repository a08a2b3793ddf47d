"""The mode benchmark's bars, the ceilings a staleness bound puts on them, and the
synchronous makespan of a workload (`dorarl bench modes`, `dorarl bench convergence`).

A bar compares a dora run's figures (`dorarl.report.figures.mode_figures`) with the other
modes'; each says whether the modes it uses were held to their pace (`paced_reliably`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dorarl.report.figures import paced_reliably


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0


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
