"""Rollout manager: how many new groups are wanted, admission, and placement on slots.

A group is tagged with the version of the instances it is placed on, at placement time;
its G samples may spread over several instances of that one version, never over two
versions. Admission (`staleness.headroom`) is checked for every group placed.
"""

from __future__ import annotations

from dorarl.controller.commands import Dispatch
from dorarl.controller.errors import require
from dorarl.controller.staleness import headroom
from dorarl.controller.state import Ledger


class RolloutManager:
    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.config = ledger.config

    def demand(self) -> int:
        """Groups wanted now: RBS minus groups still generating; none after the last step
        starts, nor once the run is stopping.

        Complete groups waiting for the trainer do not count, so rollout keeps going while
        the trainer waits; admission (not RBS) bounds how far it may run ahead.
        """
        ledger, cfg = self.ledger, self.config
        if ledger.t >= cfg.steps or ledger.stopping:
            return 0
        want = cfg.rollout_batch - (ledger.dispatched - ledger.completed)
        if cfg.max_groups is not None:
            want = min(want, cfg.max_groups - ledger.dispatched)
        return max(0, want)

    def room(self, version: int) -> int:
        """Groups admission still allows under `version`."""
        ledger = self.ledger
        bound = self.config.effective_K
        return headroom(ledger.out, version, ledger.newest, bound, ledger.t, self.config.tbs)

    def newest_demand(self) -> int:
        return min(self.demand(), self.room(self.ledger.newest))

    def supplement(self, versions: list[int]) -> list[Dispatch]:
        """Place wanted groups on `versions` in order of preference, while slots and admission allow."""
        commands: list[Dispatch] = []
        want = self.demand()
        for version in versions:
            if want <= 0:
                break
            fit = self.ledger.free.get(version, 0) // self.config.group_size
            count = min(want, fit, self.room(version))
            if count > 0:
                commands += self._place(version, count)
                want -= count
        return commands

    def _place(self, version: int, count: int) -> list[Dispatch]:
        """Place `count` groups, each on the instance with the most free slots (split if needed)."""
        ledger, size = self.ledger, self.config.group_size
        commands: list[Dispatch] = []
        for _ in range(count):
            group = ledger.new_group(version)
            placed = 0
            while placed < size:
                inst = ledger.most_free(version)
                require(inst is not None, "placement beyond the free slots counted")
                samples = range(placed, placed + min(ledger.free_slots(inst), size - placed))
                ledger.place(group, inst, samples)
                commands.append(
                    Dispatch(
                        group.group_id,
                        group.prompt_index,
                        version,
                        inst.instance_id,
                        tuple(samples),
                    )
                )
                placed = samples.stop
        return commands
