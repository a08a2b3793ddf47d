"""The recorder's own account of every group: running, complete, consumed or dropped.

Kept apart from the controller's ledger on purpose, so tests can check one against the
other. Invariant: a group is consumed once and only when complete; anything else (a
sample of an unknown group, a consumption of a running or unknown group, a group a
runtime could not keep) is counted under `dropped` with its reason.
"""

from __future__ import annotations

from collections import Counter


class GroupAccount:
    def __init__(self) -> None:
        self.state: dict[int, str] = {}  # group -> running | complete | consumed | dropped
        self._remaining: dict[int, int] = {}  # group -> samples dispatched, not finished
        self.counts: Counter = Counter()  # dispatched, completed, consumed
        self.dropped: Counter = Counter()  # reason -> groups

    def dispatched(self, group_id: int, samples: int) -> None:
        if group_id not in self.state:
            self.state[group_id] = "running"
            self._remaining[group_id] = 0
            self.counts["dispatched"] += 1
        self._remaining[group_id] += samples

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
        state = self.state.get(group_id)
        if state != "complete":
            self.dropped[f"consumed_while_{state or 'unknown'}"] += 1
        self.state[group_id] = "consumed"
        self.counts["consumed"] += 1

    def lost(self, group_id: int, reason: str) -> None:
        if self.state.get(group_id) != "dropped":
            self.state[group_id] = "dropped"
            self.dropped[reason] += 1

    def states(self) -> Counter:
        return Counter(self.state.values())
