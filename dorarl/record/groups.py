"""The recorder's own account of every group: running, complete, consumed, filtered or dropped.

Kept apart from the controller's ledger on purpose, so tests can check one against the
other. Invariant: a group ends consumed once or filtered once (dynamic sampling), never
both, and only when complete; anything else (a sample of an unknown group, a consumption
or filtering of a running, unknown, consumed or filtered group, a group a runtime could
not keep) is counted under `dropped` with its reason. A group carried over from a stopped
run starts complete (`carried_in`). So in a sound run, at every moment,
dispatched + carried_in = consumed + filtered + running + complete + dropped.
"""

from __future__ import annotations

from collections import Counter


class GroupAccount:
    def __init__(self) -> None:
        self.state: dict[
            int, str
        ] = {}  # group -> running | complete | consumed | filtered | dropped
        self._remaining: dict[int, int] = {}  # group -> samples dispatched, not finished
        self.counts: Counter = Counter()  # dispatched, completed, consumed, filtered
        self.dropped: Counter = Counter()  # reason -> groups

    def dispatched(self, group_id: int, samples: int) -> None:
        if group_id not in self.state:
            self.state[group_id] = "running"
            self._remaining[group_id] = 0
            self.counts["dispatched"] += 1
        self._remaining[group_id] += samples

    def carried(self, group_id: int) -> None:
        """A complete group a stopped run left queued, waiting for a step in this one."""
        self.state[group_id] = "complete"
        self.counts["carried_in"] += 1

    def sample_done(self, group_id: int) -> None:
        if group_id not in self._remaining:
            self.dropped["sample_of_unknown_group"] += 1
            return
        self._remaining[group_id] -= 1
        if self._remaining[group_id] == 0:
            del self._remaining[group_id]
            if self.state[group_id] == "running":
                self.state[group_id] = "complete"
                self.counts["completed"] += 1

    def consumed(self, group_id: int) -> None:
        self._end(group_id, "consumed")

    def filtered(self, group_id: int) -> None:
        self._end(group_id, "filtered")

    def _end(self, group_id: int, how: str) -> None:
        """A complete group is consumed or filtered; from any other state (running, unknown,
        or ended already) it is also counted under `dropped`, with the state it was in."""
        state = self.state.get(group_id)
        if state != "complete":
            self.dropped[f"{how}_while_{state or 'unknown'}"] += 1
        self.state[group_id] = how
        self.counts[how] += 1

    def lost(self, group_id: int, reason: str) -> None:
        if self.state.get(group_id) != "dropped":
            self.state[group_id] = "dropped"
            self.dropped[reason] += 1

    def states(self) -> Counter:
        return Counter(self.state.values())
