"""`ProtocolError`: the controller and a runtime disagree on what can happen.

Raised for an event that cannot happen in the state the controller is in (a weight load
reported for an instance that was not loading, a training step for a version not in
training), for a command no runtime can carry out, and for a broken ledger invariant. A
plain exception rather than `assert`, so `python -O` keeps every check.
"""

from __future__ import annotations


class ProtocolError(RuntimeError):
    """The controller/runtime protocol was broken; the message names the event or command."""


def require(condition: bool, message: str) -> None:
    """Raise `ProtocolError(message)` unless `condition` holds."""
    if not condition:
        raise ProtocolError(message)
