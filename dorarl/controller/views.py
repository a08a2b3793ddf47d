"""Read-only views of the controller's state, for runtimes and their recovery code.

A view is a frozen copy taken when asked: holding one never lets a caller change the
ledger, and it does not follow later events.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class InstanceView:
    """One instance as the controller sees it."""

    instance_id: int
    version: int  # assigned: hosted when `ready`, else being loaded
    ready: bool
    requests: tuple[str, ...]  # live requests placed on it, oldest first (parked ones too)
    held: tuple[int, ...] = ()  # older versions whose requests still run on it
