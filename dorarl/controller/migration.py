"""Migration planning with locality (docs/design.md, section 4), pure functions.

Only requests on instances that change version move; every other request stays put. A
release is accepted only if the instances that keep the version can take all its requests,
so no request is ever abandoned.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Candidate:
    """An instance of one version, as the release chooser sees it."""

    instance_id: int
    running: int
    free: int
    ready: bool
    pinned: bool


def choose_releases(candidates: Sequence[Candidate], count: int) -> list[int]:
    """Up to `count` instances to hand over, cheapest to empty first.

    An instance is released only when the ready, unreleased rest can absorb its requests.
    Pinned instances (loading, receiving requests, or serving weights) never move.
    """
    spare = sum(c.free for c in candidates if c.ready)
    released: list[int] = []
    order = sorted(
        (c for c in candidates if not c.pinned), key=lambda c: (c.running, c.instance_id)
    )
    for cand in order:
        if len(released) == count:
            break
        spare_without = spare - (cand.free if cand.ready else 0)
        if cand.running <= spare_without:
            released.append(cand.instance_id)
            spare = spare_without - cand.running
    return released


def plan_migrations(
    moving: Mapping[int, Sequence[str]], free: Mapping[int, int]
) -> list[tuple[tuple[str, ...], int, int]]:
    """Assign each request of `moving[src]` to the destination with the most free slots.

    Returns (request_ids, src, dst) batches, one per pair, in a deterministic order. Raises
    ValueError if the destinations cannot hold every request.
    """
    heap = [(-n, dst) for dst, n in free.items() if n > 0]
    heapq.heapify(heap)
    batches: dict[tuple[int, int], list[str]] = {}
    for src in sorted(moving):
        for rid in moving[src]:
            if not heap:
                raise ValueError(f"no free slot left for request {rid} from instance {src}")
            neg, dst = heapq.heappop(heap)
            batches.setdefault((src, dst), []).append(rid)
            if neg + 1 < 0:
                heapq.heappush(heap, (neg + 1, dst))
    return [(tuple(rids), src, dst) for (src, dst), rids in batches.items()]
