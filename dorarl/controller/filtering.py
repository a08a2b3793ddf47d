"""Dynamic sampling (DAPO, Yu et al. 2025): which completed groups leave without training.

A group whose G rewards are all equal has zero advantage for every response (GRPO's
advantage is a reward against its group's mean), so a step spent on it changes nothing.
With `rollout.filter_groups` such a group is filtered when it completes: it stops being
outstanding, which frees admission room (more prompts go out) and removes it from every
need of the batch rule, so a step is made of TBS informative groups. Invariant: a group
is filtered at most once and only when complete; it is then never consumed (it left the
ledger). Bound: at most `rollout.max_filtered_per_step` groups are filtered while one
version is the newest; after that uniform groups are queued like any other and trained
on (zero gradient), so every step still forms (docs/design.md, section 5).
"""

from __future__ import annotations

import logging

from dorarl.controller.commands import Command, FilterGroup
from dorarl.controller.state import GroupState, Ledger

log = logging.getLogger(__name__)


class GroupFilter:
    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.config = ledger.config.rollout
        self._capped_at: int | None = None  # newest version whose budget ran out (logged)

    def complete(self, group: GroupState) -> list[Command]:
        """A group just completed: queue it for training, or filter it."""
        ledger = self.ledger
        if not self._filters(group):
            ledger.queue(group)
            return []
        ledger.filter(group)
        return [FilterGroup(group.group_id, group.version, ledger.newest)]

    def _filters(self, group: GroupState) -> bool:
        if not self.config.filter_groups or group.mixed:
            return False
        if self.ledger.filtered_since_publish < self.config.max_filtered_per_step:
            return True
        if self._capped_at != self.ledger.newest:
            self._capped_at = self.ledger.newest
            log.info(
                "step %d: rollout.max_filtered_per_step=%d groups filtered; further groups "
                "of equal rewards are trained on until the next version",
                self.ledger.newest,
                self.config.max_filtered_per_step,
            )
        return False
