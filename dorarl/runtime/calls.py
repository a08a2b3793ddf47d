"""The Ray runtime's remote calls in flight, each waiting for its answer.

Every call whose result or failure the runtime must see is one record here, of its own
type: what it is (a stepping burst, a weight load, a migration, a call read only for its
failure; a training step, a replayed one, a checkpoint write) with the fields its answer
needs, its answer's reference, when it was sent, and the incarnation of each engine
instance then (`generations`: an instance's number goes up each time a dead actor is
replaced), so a result from a replaced actor is recognised as stale. `ready` gives results
in submission order: an actor runs its calls in that order, but Ray orders nothing across
actors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import ray

from dorarl.controller import TRAINER
from dorarl.runtime.recovery.trainer_log import SaveCall, TrainCall

DEATHS = (
    ray.exceptions.ActorDiedError,
    ray.exceptions.ActorUnavailableError,
    ray.exceptions.OutOfMemoryError,
)
"""What a call raises when its actor (or one its arguments came from) is gone: Ray's memory
monitor killing it raises OutOfMemoryError, not ActorDiedError."""

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


@dataclass(frozen=True, kw_only=True)
class Call:
    """A remote call in flight: its answer `ref`, when it was sent (the runtime's clock),
    and each engine instance's incarnation then."""

    ref: ray.ObjectRef
    started: float
    generations: tuple[int, ...] = ()

    @property
    def worker(self) -> str:
        """The worker it ran on and what it did, for error messages."""
        raise NotImplementedError


# ---- calls on engine actors --------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class EngineCall(Call):
    @property
    def lands_on(self) -> int:
        """The instance whose actor answers it."""
        raise NotImplementedError

    @property
    def engines(self) -> tuple[int, ...]:
        """Every instance whose actor it needs."""
        raise NotImplementedError


@dataclass(frozen=True)
class OnInstanceCall(EngineCall):
    """A call on instance `iid` alone."""

    iid: int

    @property
    def lands_on(self) -> int:
        return self.iid

    @property
    def engines(self) -> tuple[int, ...]:
        return (self.iid,)


@dataclass(frozen=True)
class RunCall(OnInstanceCall):
    """A stepping burst on instance `iid`."""

    @property
    def worker(self) -> str:
        return f"engine instance {self.iid} (decoding)"


@dataclass(frozen=True)
class LoadCall(EngineCall):
    """Instance `iid` loads `version` from `source`: TRAINER or a peer instance."""

    iid: int
    version: int
    source: int

    @property
    def lands_on(self) -> int:
        return self.iid

    @property
    def engines(self) -> tuple[int, ...]:
        return (self.iid,) if self.source == TRAINER else (self.iid, self.source)

    @property
    def worker(self) -> str:
        return f"engine instance {self.iid} (weight load)"


@dataclass(frozen=True)
class RestoreCall(LoadCall):
    """A replacement actor takes back `version`, which its instance held: nothing the
    controller reads answers it (it never saw the instance go); a failure leaves the actor
    on weights it was never meant to serve."""

    @property
    def worker(self) -> str:
        return f"engine instance {self.iid} (taking version {self.version} back)"


@dataclass(frozen=True)
class MigrateCall(EngineCall):
    """Requests `request_ids` move from `src` to `dst`: the source's export gives the ids it
    exported (`exported`) and their `snapshots`, which the destination imports; with
    `parcel` their KV goes over the group, outside the snapshots."""

    src: int
    dst: int
    request_ids: tuple[str, ...]
    exported: ray.ObjectRef
    snapshots: ray.ObjectRef
    parcel: bool

    @property
    def lands_on(self) -> int:
        return self.dst

    @property
    def engines(self) -> tuple[int, ...]:
        return (self.src, self.dst)

    @property
    def worker(self) -> str:
        return f"engine instance {self.src} or {self.dst} (request migration)"


@dataclass(frozen=True)
class SendCall(OnInstanceCall):
    """A call on instance `iid` that changes what it holds and answers nothing the runtime
    acts on (`what`: requests added, an observation, versions to keep): read only for its
    failure, which stops the run (a lost actor's is recovery's, which starts the
    instance's requests again), so no request stays counted on an engine that lacks it."""

    what: str

    @property
    def worker(self) -> str:
        return f"engine instance {self.iid} ({self.what})"


# ---- calls on the trainer actor ----------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class TrainerCall(Call):
    pass


@dataclass(frozen=True)
class _TrainingStep(TrainerCall):
    """A training step in flight: `step`, and `weights`, the version it makes, as the weight
    transport publishes it."""

    step: TrainCall
    weights: Any

    @property
    def worker(self) -> str:
        return f"the trainer (training step {self.step.version})"


@dataclass(frozen=True)
class StepCall(_TrainingStep):
    """The training step `step`, whose TrainDone is to come."""


@dataclass(frozen=True)
class ReplayCall(_TrainingStep):
    """A step a dead trainer made (its TrainDone delivered), made again by its successor."""


@dataclass(frozen=True)
class CheckpointCall(TrainerCall):
    """The checkpoint write `save`."""

    save: SaveCall

    @property
    def worker(self) -> str:
        return f"the trainer (checkpoint of version {self.save.version})"


C = TypeVar("C", bound=Call)


class CallTable:
    def __init__(self) -> None:
        self._calls: dict[ray.ObjectRef, Call] = {}  # in submission order (dicts keep it)

    def submit(self, call: Call) -> None:
        self._calls[call.ref] = call

    def ready(self, timeout: float) -> list[ray.ObjectRef]:
        """Calls whose answer is in (a result or an error), in submission order; waits up to
        `timeout` seconds for the first."""
        refs = list(self._calls)
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout)
        if ready:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        answered = set(ready)
        return [ref for ref in refs if ref in answered]

    def take(self, ref: ray.ObjectRef) -> Call | None:
        """The call of `ref`, out of the table; None if it was dropped meanwhile."""
        return self._calls.pop(ref, None)

    def drop(self, kind: type[Call]) -> None:
        """Forget every call of `kind` (a dead trainer's: all replayed by its successor)."""
        for ref in [ref for ref, call in self._calls.items() if isinstance(call, kind)]:
            del self._calls[ref]

    def of_kind(self, kind: type[C]) -> list[C]:
        """The calls of `kind` in flight, in submission order."""
        return [call for call in self._calls.values() if isinstance(call, kind)]

    def __len__(self) -> int:
        return len(self._calls)
