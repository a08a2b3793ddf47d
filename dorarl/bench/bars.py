"""The mode benchmark's bars, the ceilings a staleness bound puts on them, and the
synchronous makespan of a workload (`dorarl bench modes`, `dorarl bench convergence`).

A bar compares a dora run's figures (`dorarl.report.figures.mode_figures`) with the other
modes'; each says whether the modes it uses were held to their pace (`paced_reliably`).
"""

from __future__ import annotations

import statistics
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
def staleness_ceiling(
    k: int, rollout_s: Sequence[float], train_s: Sequence[float]
) -> tuple[float, float]:
    """(most step-rate speedup over sync, least rollout-only share) a schedule with bound K
    can reach on the sync run's measured steps: R_b the rollout of batch b (its slowest
    group), T_b its training step, in order.

    A group of version v goes out no earlier than v's publish (the end of step v-1) and is
    trained by step v+K. At K=1 that ties every step to one batch: admission leaves TBS
    groups to each version, and step v+1 must take all of them, so each step waits for its
    own batch's slowest group (`_batch_by_batch`). From K=2 on a version holds
    several batches' worth, and a slow group can be trained steps after the rest of its
    batch while later groups fill the steps between: only the means bound that
    (`_steady_state`).
    """
    if k <= 1:
        return _batch_by_batch(k, rollout_s, train_s)
    return _steady_state(k, statistics.mean(rollout_s), statistics.mean(train_s))


def _batch_by_batch(
    k: int, rollout_s: Sequence[float], train_s: Sequence[float]
) -> tuple[float, float]:
    """Step b starts no earlier than the end of step b-1, nor R_b after the end of step
    b-K-1 (the publish of the version batch b went out under). The first K steps train
    batches that went out before the measured steps, and wait for training alone (the best
    a warm-up can leave). Batches that differ leave less than their mean would: at K=1 a
    long batch holds up its step for all it takes, while a short one saves nothing once it
    is done before the training ahead of its own step has ended."""
    published = [0.0]  # published[b]: the end of measured step b-1
    for b, (rollout, train) in enumerate(zip(rollout_s, train_s, strict=True)):
        start = published[b]
        if b >= k:
            start = max(start, published[b - k] + rollout)
        published.append(start + train)
    wall, training = published[-1], sum(train_s)
    return _share(sum(rollout_s) + training, wall), _share(wall - training, wall)


def _steady_state(k: int, rollout_s: float, train_s: float) -> tuple[float, float]:
    """Batches that all take R and T: step t+K starts at least T + R after step t-1 does,
    so in steady state a step every P >= max(T, (R + T) / (K + 1)); sync takes R + T."""
    period = max(train_s, (rollout_s + train_s) / (k + 1))
    return _share(rollout_s + train_s, period), _share(period - train_s, period)


def check_bars(results: dict[str, dict], dora: str) -> list[dict[str, Any]]:
    """The benchmark's bars for the dora run named `dora`, each with its figure and the
    ceiling the run's staleness bound puts on it (`staleness_ceiling`, from the sync run's
    measured steps)."""
    tps = {m: r["consumed_tokens_per_s"] for m, r in results.items()}
    sync = results["sync"]
    k = int(results[dora].get("K", dora.rsplit("_k", 1)[-1]))
    steps = sync["per_step"]
    most_speedup, least_share = staleness_ceiling(k, steps["rollout_only_s"], steps["train_time_s"])

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
