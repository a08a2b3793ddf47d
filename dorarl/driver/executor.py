"""What a runtime supplies to the driver: how to carry out each command on its machinery.

The driver decides nothing and executes nothing itself: for every command the controller
returns it updates its own bookkeeping (requests, groups) and calls the executor, which
performs the command on its engines and trainer (Ray actors, cost-model instances, ...).
An executor answers later through the driver (`Driver.sample_done`, `migration_done`,
`train_done`, `deliver`), from its own event source, with the events each command
obliges (`dorarl.controller.commands`).
"""

from __future__ import annotations

from typing import Protocol

from dorarl.controller import Dispatch, Interrupt, LoadWeights, Migrate, Offload, Resume
from dorarl.data import Group
from dorarl.driver.requests import RequestSpec


class Executor(Protocol):
    def dispatch(self, command: Dispatch, requests: list[RequestSpec]) -> None:
        """Start `requests` (the command's samples, with their seeds and target lengths)."""

    def load_weights(self, command: LoadWeights) -> None:
        """Load a version; answer `WeightsLoaded`. How weights travel is the runtime's."""

    def migrate(self, command: Migrate) -> None:
        """Move requests with their KV; answer `Driver.migration_done`."""

    def interrupt(self, command: Interrupt) -> None: ...

    def resume(self, command: Resume) -> None: ...

    def offload(self, command: Offload) -> None: ...

    def train(self, version: int, groups: list[Group]) -> None:
        """Train `version` on `groups` (complete, in the Train's order); answer
        `Driver.train_done`."""

    def set_timer(self, at: float) -> None:
        """Deliver `Timer` at or after `at`."""
