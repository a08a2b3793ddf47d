"""What a runtime supplies to the driver: how to carry out each command on its machinery.

The driver decides nothing and executes nothing itself: for every command the controller
returns it updates its own bookkeeping (requests, groups) and hands the command to the
runtime's `Executor`: rollout commands to its engines (`Rollout`), Train to its trainer,
SetTimer to its event source. The executor answers later through the driver
(`Driver.sample_done`, `migration_done`, `train_done`, `deliver`), from its own event
source, with the events each command obliges (`dorarl.controller.commands`). The driver
makes its executor with itself (`Driver(..., executor=make)`: `make(driver)`), so the
machinery has the driver it answers to from the start.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from dorarl.controller import (
    Dispatch,
    Interrupt,
    LoadWeights,
    Migrate,
    Offload,
    ReleaseVersion,
    Resume,
)
from dorarl.data import Group
from dorarl.driver.requests import RequestSpec


class Rollout(Protocol):
    """The engines' side: every command naming an instance."""

    def dispatch(self, command: Dispatch, requests: list[RequestSpec]) -> None:
        """Start `requests` (the command's samples, with their seeds and target lengths)."""

    def load_weights(self, command: LoadWeights) -> None:
        """Load a version; answer `WeightsLoaded`. How weights travel is the runtime's."""

    def release_version(self, command: ReleaseVersion) -> None:
        """Drop an older version's weights from an instance that holds several; no answer."""

    def migrate(self, command: Migrate) -> None:
        """Move requests with their KV; answer `Driver.migration_done`."""

    def interrupt(self, command: Interrupt) -> None: ...

    def resume(self, command: Resume) -> None: ...

    def offload(self, command: Offload) -> None: ...


@dataclass(frozen=True)
class Executor:
    """Where the driver sends the commands it does not keep to itself."""

    rollout: Rollout
    train: Callable[[int, list[Group]], None]
    """Train a version on its groups (complete, in the Train's order); answer
    `Driver.train_done`."""
    set_timer: Callable[[float], None]
    """Deliver `Timer` at or after the time given."""
