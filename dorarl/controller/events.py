"""Events: what a runtime tells the controller. Plain frozen dataclasses; time is data.

`now` is seconds since run start on the runtime's clock (virtual in the simulator, wall
in the Ray runtime). Events from one instance must reach the controller in the order the
instance produced them; the controller tolerates events about requests it has already
moved or finished (e.g. a SampleDone that raced a Migrate).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CarriedGroup:
    """A complete, untrained group a stopped run saved with its checkpoint: it waits for a
    training step again under its own version (its samples are the driver's)."""

    group_id: int
    prompt_index: int
    version: int


@dataclass(frozen=True, slots=True)
class Start:
    """The run begins; every instance hosts its first version and is ready. `carried`: the
    complete groups a stopped run left queued, oldest version first, in completion order."""

    now: float = 0.0
    carried: tuple[CarriedGroup, ...] = ()


@dataclass(frozen=True, slots=True)
class Stop:
    """The run is asked to stop: no new group and no new training step; the step in flight
    and the requests in flight finish, then `Finish`. Requests still running at `deadline`
    are left (the runtime counts their groups dropped; a resume samples their prompts)."""

    now: float
    deadline: float


@dataclass(frozen=True, slots=True)
class SampleDone:
    """One sample (request `request_id(group_id, sample_index)`) finished on `instance_id`,
    scored `reward` (what dynamic sampling, `rollout.filter_groups`, decides on)."""

    group_id: int
    sample_index: int
    instance_id: int
    num_tokens: int
    now: float
    reward: float = 0.0


@dataclass(frozen=True, slots=True)
class InstanceStats:
    """Load report. Required at least whenever `kv_used_frac` crosses the controller's
    `kv_offload_threshold` (either way); reporting every engine step is fine. Each report
    at or above the threshold makes the controller relieve the instance by one request
    (a `Migrate` to a same-version peer in dora, else an `Offload`)."""

    instance_id: int
    running: int
    waiting: int
    kv_used_frac: float
    now: float


@dataclass(frozen=True, slots=True)
class WeightsLoaded:
    """Answer to `LoadWeights`: the instance now serves `version`."""

    instance_id: int
    version: int
    now: float


@dataclass(frozen=True, slots=True)
class MigrationDone:
    """Answer to `Migrate`: `request_ids` now run on `dst` (ones that had finished are left out)."""

    request_ids: tuple[str, ...]
    src: int
    dst: int
    now: float


@dataclass(frozen=True, slots=True)
class EnvWaiting:
    """A multi-turn episode (request `request_id(group_id, sample_index)`) ended a turn and
    waits for its environment: its engine keeps its KV but gives it no decode slot. Its
    reward and completion still come as one `SampleDone` (possibly straight from waiting)."""

    group_id: int
    sample_index: int
    now: float


@dataclass(frozen=True, slots=True)
class EnvAnswered:
    """The waiting episode's environment answered and its next turn is queued on its engine
    (where it sits now: an answer that finds it migrating or interrupted is reported once it
    is handed over). An episode that starts again from its prompt is running again too."""

    group_id: int
    sample_index: int
    now: float


@dataclass(frozen=True, slots=True)
class TrainDone:
    """Answer to `Train`: the trainer published `new_version` (= the Train's version + 1)."""

    new_version: int
    now: float


@dataclass(frozen=True, slots=True)
class Timer:
    """Answer to `SetTimer`, delivered at or after the requested time."""

    now: float


Event = (
    Start
    | Stop
    | SampleDone
    | EnvWaiting
    | EnvAnswered
    | InstanceStats
    | WeightsLoaded
    | MigrationDone
    | TrainDone
    | Timer
)
