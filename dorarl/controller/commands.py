"""Commands: what the controller asks a runtime to do, and what each obliges it to answer.

Runtime rules that hold for every command:
- commands are executed in list order; commands naming the same instance never reorder
  (a `Migrate` off an instance is exported before a later `LoadWeights` on it);
- a runtime takes no scheduling decision of its own: it places, moves, interrupts and
  trains exactly what it is told, and reports back with the named event.
Request ids are `request_id(group_id, sample_index)`.
"""

from __future__ import annotations

from dataclasses import dataclass

TRAINER = -1
"""Weight source meaning "the trainer" (otherwise a source is a peer instance id)."""


def request_id(group_id: int, sample_index: int) -> str:
    return f"{group_id}:{sample_index}"


def parse_request_id(rid: str) -> tuple[int, int]:
    group, sample = rid.split(":")
    return int(group), int(sample)


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Start samples `sample_indices` of group `group_id` (prompt `prompt_index` of the
    dataset, modulo its size) on `instance_id`, which hosts `version`. Every token is
    sampled by `version`. Answer: one `SampleDone` per sample when it finishes."""

    group_id: int
    prompt_index: int
    version: int
    instance_id: int
    sample_indices: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LoadWeights:
    """Load `version` from `source` (`TRAINER` or a peer instance that hosts it; the peer
    keeps it until this load ends). With one version per instance the instance holds no
    request when this runs, so the old version's KV is gone (an engine that keeps cache
    beyond its requests frees it here). With several (`versions_per_instance`), requests
    of the versions it held keep running beside the load, under their own version, until
    `ReleaseVersion`. Answer: `WeightsLoaded(instance_id, version)`."""

    instance_id: int
    version: int
    source: int


@dataclass(frozen=True, slots=True)
class ReleaseVersion:
    """No request on `instance_id` runs under `version` any more, and the instance has moved
    on to a newer one: it drops that version's weights (a LoRA adapter's slot). Comes before
    any load the same answer brings. No answer."""

    instance_id: int
    version: int


@dataclass(frozen=True, slots=True)
class Migrate:
    """Move running requests from `src` to `dst` (same version) with their full state and
    KV cache, no re-prefill; skip ones that already finished. Answer: `MigrationDone`
    listing the moved ids once they run on `dst`."""

    request_ids: tuple[str, ...]
    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class Interrupt:
    """Partial rollout: abort `request_ids` on `instance_id`, drop their KV, keep their
    tokens, logprobs and per-token versions for a later `Resume`. No answer."""

    instance_id: int
    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Resume:
    """Partial rollout: continue interrupted requests on `instance_id` (which hosts
    `version`) by re-prefilling prompt + partial output; new tokens get `version`.
    Answer: `SampleDone` per request when it finishes."""

    request_ids: tuple[str, ...]
    instance_id: int
    version: int


@dataclass(frozen=True, slots=True)
class Offload:
    """KV pressure: move `request_id`'s KV cache to host memory; the engine restores it
    once its KV usage is back under the threshold. No answer (later stats show it)."""

    instance_id: int
    request_id: str


@dataclass(frozen=True, slots=True)
class Train:
    """Run one optimizer step on the completed groups `group_ids` with the trainer at
    `version`, then publish `version + 1`. Answer: `TrainDone(version + 1)`."""

    group_ids: tuple[int, ...]
    version: int


@dataclass(frozen=True, slots=True)
class FilterGroup:
    """Dynamic sampling: the completed group `group_id` (of `version`) is not trained on,
    its rewards being all equal (zero advantage). It was filtered while `step` was the
    newest version, i.e. during the training step that makes `step + 1`. The driver closes
    the group and records it; the machinery has nothing to do (every sample is finished).
    No answer."""

    group_id: int
    version: int
    step: int


@dataclass(frozen=True, slots=True)
class DropGroup:
    """A complete group carried over from a stopped run (`Start.carried`) that this run
    cannot train on: its `version` is outside the staleness window (or admission's room).
    The driver closes it and records it as dropped for `reason`. No answer."""

    group_id: int
    version: int
    reason: str


@dataclass(frozen=True, slots=True)
class SetTimer:
    """Deliver `Timer(now)` at or after time `at` (seconds since start)."""

    at: float


@dataclass(frozen=True, slots=True)
class Finish:
    """The run is over: stop rollout and report. No answer."""

    reason: str


Command = (
    Dispatch
    | LoadWeights
    | ReleaseVersion
    | Migrate
    | Interrupt
    | Resume
    | Offload
    | Train
    | FilterGroup
    | DropGroup
    | SetTimer
    | Finish
)
