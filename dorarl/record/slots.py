"""Busy slots per instance over time: which instance each request occupies, and the
integral of busy slots (slot-seconds) that slot utilisation divides by capacity.

A request occupies one slot of the instance it was dispatched, migrated or resumed to,
and none while interrupted (parked), while an episode waits for its environment, or once
finished; requests a command names that are not where it says (finished first) are
skipped, as the runtimes skip them. Episodes answered at once can hold more requests
than an instance has slots (the engine queues the rest): the integral counts at most its
`slots` busy, so utilisation stays a share of the capacity.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

BusyHook = Callable[[int, float, int], None]  # instance, time, busy slots


class SlotUsage:
    def __init__(
        self, instances: int, on_change: BusyHook | None = None, slots: int | None = None
    ) -> None:
        self.slots = slots  # busy slots an instance can have at most (None: no bound)
        self.busy = [0] * instances
        self.area = [0.0] * instances  # busy slot-seconds since the start
        self._area_at = [0.0] * instances
        self._where: dict[str, int] = {}  # request -> instance it occupies
        self._parked: dict[str, int] = {}  # interrupted request -> instance it left
        self._idle: set[str] = set()  # episodes waiting for their environment: no slot
        self.held = [0] * instances  # requests on each instance, waiting episodes included
        self.peak_held = [0] * instances  # the most it held at once
        self.on_change = on_change

    def placed(self, request_ids: Iterable[str], instance: int, now: float) -> None:
        ids = list(request_ids)
        for rid in ids:
            self._where[rid] = instance
        self._hold(instance, len(ids))
        self._change(instance, len(ids), now)

    def finished(self, request_id: str, now: float) -> None:
        idle = request_id in self._idle
        self._idle.discard(request_id)
        instance = self._where.pop(request_id, None)
        if instance is not None:
            self._hold(instance, -1)
            self._change(instance, -(not idle), now)
        else:
            self._parked.pop(request_id, None)

    def waits(self, request_id: str, now: float, waiting: bool = True) -> None:
        """An episode waits for its environment (its slot is free) or runs again."""
        if request_id not in self._where and request_id not in self._parked:
            return
        if waiting == (request_id in self._idle):
            return
        if waiting:
            self._idle.add(request_id)
        else:
            self._idle.discard(request_id)
        if request_id in self._where:
            self._change(self._where[request_id], 1 if not waiting else -1, now)

    def moved(self, request_ids: Iterable[str], src: int, dst: int, now: float) -> int:
        """Move the named requests still on `src`; returns how many moved."""
        moved = [r for r in request_ids if self._where.get(r) == src]
        for rid in moved:
            self._where[rid] = dst
        busy = self._busy(moved)
        self._hold(src, -len(moved))
        self._hold(dst, len(moved))
        self._change(src, -busy, now)
        self._change(dst, busy, now)
        return len(moved)

    def parked(self, request_ids: Iterable[str], instance: int, now: float) -> None:
        stopped = [r for r in request_ids if self._where.get(r) == instance]
        for rid in stopped:
            del self._where[rid]
            self._parked[rid] = instance
        self._hold(instance, -len(stopped))
        self._change(instance, -self._busy(stopped), now)

    def resumed(self, request_ids: Iterable[str], instance: int, now: float) -> None:
        resumed = [r for r in request_ids if self._parked.pop(r, None) is not None]
        for rid in resumed:
            self._where[rid] = instance
        self._hold(instance, len(resumed))
        self._change(instance, self._busy(resumed), now)

    def _hold(self, instance: int, delta: int) -> None:
        self.held[instance] += delta
        self.peak_held[instance] = max(self.peak_held[instance], self.held[instance])

    def _busy(self, request_ids: list[str]) -> int:
        return sum(rid not in self._idle for rid in request_ids)

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
            self.on_change(instance, now, self._decoding(instance))

    def _decoding(self, instance: int) -> int:
        busy = self.busy[instance]
        return busy if self.slots is None else min(busy, self.slots)

    def _settle(self, instance: int, now: float) -> None:
        self.area[instance] += self._decoding(instance) * (now - self._area_at[instance])
        self._area_at[instance] = now
