"""Virtual clock: a min-heap of (time, sequence, item); ties pop in push order (deterministic)."""

from __future__ import annotations

import heapq
from typing import Any


class EventQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = 0

    def push(self, at: float, item: Any) -> None:
        heapq.heappush(self._heap, (at, self._seq, item))
        self._seq += 1

    def pop(self) -> tuple[float, Any]:
        at, _, item = heapq.heappop(self._heap)
        return at, item

    def __len__(self) -> int:
        return len(self._heap)
