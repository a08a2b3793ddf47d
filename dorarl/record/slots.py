"""Busy slots per instance over time: which instance each request occupies, and the
integral of busy slots (slot-seconds) that slot utilisation divides by capacity.

A request occupies one slot of the instance it was dispatched, migrated or resumed to,
and none while interrupted (parked) or once finished; requests a command names that are
not where it says (finished first) are skipped, as the runtimes skip them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

BusyHook = Callable[[int, float, int], None]  # instance, time, busy slots


class SlotUsage:
    def __init__(self, instances: int, on_change: BusyHook | None = None) -> None:
        self.busy = [0] * instances
        self.area = [0.0] * instances  # busy slot-seconds since the start
        self._area_at = [0.0] * instances
        self._where: dict[str, int] = {}  # request -> instance it occupies
        self._parked: dict[str, int] = {}  # interrupted request -> instance it left
        self.on_change = on_change

    def placed(self, request_ids: Iterable[str], instance: int, now: float) -> None:
        ids = list(request_ids)
        for rid in ids:
            self._where[rid] = instance
        self._change(instance, len(ids), now)

    def finished(self, request_id: str, now: float) -> None:
        instance = self._where.pop(request_id, None)
        if instance is not None:
            self._change(instance, -1, now)
        else:
            self._parked.pop(request_id, None)

    def moved(self, request_ids: Iterable[str], src: int, dst: int, now: float) -> int:
        """Move the named requests still on `src`; returns how many moved."""
        moved = [r for r in request_ids if self._where.get(r) == src]
        for rid in moved:
            self._where[rid] = dst
        self._change(src, -len(moved), now)
        self._change(dst, len(moved), now)
        return len(moved)

    def parked(self, request_ids: Iterable[str], instance: int, now: float) -> None:
        stopped = [r for r in request_ids if self._where.get(r) == instance]
        for rid in stopped:
            del self._where[rid]
            self._parked[rid] = instance
        self._change(instance, -len(stopped), now)

    def resumed(self, request_ids: Iterable[str], instance: int, now: float) -> None:
        resumed = [r for r in request_ids if self._parked.pop(r, None) is not None]
        for rid in resumed:
            self._where[rid] = instance
        self._change(instance, len(resumed), now)

    def settle(self, now: float) -> None:
        """Bring every instance's slot-seconds up to `now`."""
        for instance in range(len(self.busy)):
            self._settle(instance, now)

    def _change(self, instance: int, delta: int, now: float) -> None:
        if not delta:
            return
        self._settle(instance, now)
        self.busy[instance] += delta
        if self.on_change is not None:
            self.on_change(instance, now, self.busy[instance])

    def _settle(self, instance: int, now: float) -> None:
        self.area[instance] += self.busy[instance] * (now - self._area_at[instance])
        self._area_at[instance] = now
