"""Partition plan: instances per version (docs/design.md, section 4), a pure function.

Invariants of the result: the counts sum to the number of instances; every version keeps at
least its floor (the instances its running requests need, so no version with work ever
drops to zero); a legacy version never exceeds its cap (its current count: legacy versions
only shrink); seats left once every version with work is served go to the newest. Floors
are the caller's: dora packs a legacy version by KV (`packing_limit`), not by slots.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping

from dorarl.controller.errors import require


def capacity_floor(running: int, slots: int) -> int:
    """Instances needed to hold `running` requests at `slots` each."""
    return -(-running // slots)


def kv_fit(running: int, kv_used_frac: float, threshold: float) -> float:
    """Requests of an instance's current mix that fit under the KV threshold, from one load
    report: `running` resident requests filled `kv_used_frac` of the pool."""
    return running * threshold / kv_used_frac


def packing_limit(slots: int, fits: Iterable[float | None]) -> int:
    """Requests one instance of a version can keep resident: its slots, or fewer where a KV
    report showed fewer fit. The tightest instance counts: a legacy version's survivors
    only grow, so the past mix under-states what they will need."""
    known = [int(f) for f in fits if f is not None]
    return max(1, min([slots, *known]))


def plan_partition(
    workload: Mapping[int, int],
    floors: Mapping[int, int],
    caps: Mapping[int, int],
    newest: int,
    num_instances: int,
) -> dict[int, int]:
    """Target instance count per version: floors first, the rest in proportion to workload.

    `workload[v]` is in requests (running, plus the newest's pending demand), `floors[v]`
    the minimum count, `caps[v]` the maximum (absent: unbounded). Whole proportional shares
    go out in rounds (O(versions), whatever the cluster size); the last few seats go by the
    Sainte-Lague quotient, ties to newer versions.
    """
    versions = sorted(set(workload) | set(floors) | {newest})
    target = {v: floors.get(v, 0) for v in versions}
    seats = num_instances - sum(target.values())
    require(seats >= 0, f"floors {dict(floors)} exceed {num_instances} instances")
    growable = [v for v in versions if _can_grow(workload, caps, target, v)]
    while growable and seats >= len(growable):
        total = sum(workload[v] for v in growable)
        for v in growable:
            extra = min(seats * workload[v] // total, caps.get(v, _NO_CAP) - target[v])
            target[v] += extra
        seats = num_instances - sum(target.values())
        growable = [v for v in growable if _can_grow(workload, caps, target, v)]
    heap = [_priority(workload, target, v) for v in growable]
    heapq.heapify(heap)
    while seats and heap:
        _, _, v = heapq.heappop(heap)
        target[v] += 1
        seats -= 1
        if _can_grow(workload, caps, target, v):
            heapq.heappush(heap, _priority(workload, target, v))
    target[newest] += seats
    return {v: n for v, n in target.items() if n > 0 or v == newest}


_NO_CAP = 1 << 62


def _can_grow(workload: Mapping[int, int], caps: Mapping[int, int], target: dict, v: int) -> bool:
    return workload.get(v, 0) > 0 and target[v] < caps.get(v, _NO_CAP)


def _priority(workload: Mapping[int, int], target: dict, v: int) -> tuple[float, int, int]:
    # Sainte-Lague quotient: the next seat goes to the largest workload per (seats + 1/2).
    return (-workload[v] / (target[v] + 0.5), -v, v)
