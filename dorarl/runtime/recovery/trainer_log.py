"""The trainer's state-changing calls since the newest durable checkpoint (dorarl.runtime.recovery.trainer_recovery).

Every training step (`TrainCall`, with its batch) and checkpoint write (`SaveCall`, with
its data position) is recorded in submission order; `durable` cuts what a completed
checkpoint already contains, so `since(v)` is exactly what a trainer restored at `v`
must replay to be the lost one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dorarl.data import Group


@dataclass(frozen=True)
class TrainCall:
    """The step that trains `version` into `version + 1` on `groups`."""

    version: int
    groups: list[Group]


@dataclass(frozen=True)
class SaveCall:
    """A checkpoint of `version` written to `folder` with the data position `position`."""

    version: int
    folder: str
    position: dict[str, Any] = field(default_factory=dict)
    keep: int = 0


Logged = TrainCall | SaveCall


class TrainerLog:
    """The trainer's state-changing calls since the newest durable checkpoint (`base`)."""

    def __init__(self, base: int) -> None:
        self.base = base
        self.calls: list[Logged] = []

    def record(self, call: Logged) -> None:
        self.calls.append(call)

    def durable(self, version: int) -> None:
        """A checkpoint of `version` is complete: calls it already contains are dropped."""
        if version <= self.base:
            return
        self.base = version
        self.calls = [c for c in self.calls if not _contained_in(c, version)]

    def since(self, version: int) -> list[Logged]:
        """The calls that bring a trainer restored at `version` back to the lost one's state."""
        if version < self.base:
            raise RuntimeError(f"trainer log starts at v{self.base}, cannot replay from v{version}")
        return [c for c in self.calls if not _contained_in(c, version)]


def _contained_in(call: Logged, version: int) -> bool:
    """Whether a checkpoint of `version` already reflects `call`."""
    return call.version < version if isinstance(call, TrainCall) else call.version <= version
