"""The Ray runtime's remote calls in flight, each waiting for its answer.

Every call whose result the runtime acts on is submitted here with its kind and what it
needs to act (`args`), and the incarnation of each engine instance at submission
(`generations`: an instance's number goes up each time a dead actor is replaced), so a
result from a replaced actor is recognised as stale. `ready` gives results in submission
order: an actor runs its calls in that order, but Ray orders nothing across actors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray

ENGINE_KINDS = ("run", "load", "migrate")
"""Calls on engine actors: a stepping burst, a weight load, a migration (export + import)."""

TRAINER_KINDS = ("train", "replay", "save")
"""Calls on the trainer actor."""

DEATHS = (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError)
"""What a call raises when its actor (or one its arguments came from) is gone."""

ANSWER_WAIT_S = 30.0
"""How long `lives` waits for an answer; an actor that takes longer is busy, not dead."""


def lives(answer: ray.ObjectRef, wait_s: float = ANSWER_WAIT_S) -> bool:
    """Whether the actor asked for `answer` (a cheap call) lives: False when it is gone, True
    when it answers or is still busy after `wait_s` (an actor runs its calls in order, so
    a long one delays the answer of a process that lives)."""
    try:
        ray.get(answer, timeout=wait_s)
    except DEATHS:
        return False
    except ray.exceptions.GetTimeoutError:
        return True
    return True


@dataclass
class Call:
    kind: str
    args: tuple[Any, ...]
    ref: ray.ObjectRef
    started: float
    seq: int
    generations: tuple[int, ...] = ()


class CallTable:
    def __init__(self) -> None:
        self._calls: dict[ray.ObjectRef, Call] = {}
        self._seq = 0

    def submit(
        self,
        ref: ray.ObjectRef,
        kind: str,
        args: tuple[Any, ...],
        started: float,
        generations: tuple[int, ...] = (),
    ) -> Call:
        self._seq += 1
        call = self._calls[ref] = Call(kind, args, ref, started, self._seq, generations)
        return call

    def ready(self, timeout: float) -> list[ray.ObjectRef]:
        """Calls whose answer is in (a result or an error), in submission order; waits up to
        `timeout` seconds for the first."""
        refs = list(self._calls)
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout)
        if ready:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return sorted(ready, key=lambda ref: self._calls[ref].seq)

    def take(self, ref: ray.ObjectRef) -> Call | None:
        """The call of `ref`, out of the table; None if it was dropped meanwhile."""
        return self._calls.pop(ref, None)

    def drop(self, kinds: tuple[str, ...]) -> None:
        """Forget every call of `kinds` (a dead trainer's: all replayed by its successor)."""
        for ref in [ref for ref, call in self._calls.items() if call.kind in kinds]:
            del self._calls[ref]

    def of_kind(self, kind: str) -> list[Call]:
        """The calls of `kind` in flight, in submission order."""
        return sorted((c for c in self._calls.values() if c.kind == kind), key=lambda c: c.seq)

    def __len__(self) -> int:
        return len(self._calls)
