"""The driver's request table: what each live request is and where it is.

A request is live from the Dispatch that starts it until the one completion the driver
accepts for it. While live it is placed on one instance (counted in `held`), or parked
(interrupted, partial rollout), and may be moving: a migration keeps it placed on its
source until the driver learns where it landed. Invariant: a request is completed at most
once (`finish` returns None for one that is not live, so a duplicate report is refused).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """How a request was started: enough to start it again from its prompt anywhere."""

    request_id: str
    group_id: int
    sample_index: int
    prompt_index: int
    version: int
    seed: int  # its own sampling seed: its tokens do not depend on where it runs
    target_len: int | None = None  # forced response length (benchmarks, the simulator)


@dataclass(slots=True)
class LiveRequest:
    spec: RequestSpec
    instance_id: int | None  # None while parked
    moving: bool = False


class RequestTable:
    def __init__(self, instances: int) -> None:
        self._live: dict[str, LiveRequest] = {}
        self._held = [0] * instances

    # ---- queries -------------------------------------------------------------------------
    def live(self, request_id: str) -> bool:
        return request_id in self._live

    def spec(self, request_id: str) -> RequestSpec:
        return self._live[request_id].spec

    def instance_of(self, request_id: str) -> int | None:
        """The instance a live request is placed on (its source while it migrates)."""
        return self._live[request_id].instance_id

    def is_moving(self, request_id: str) -> bool:
        return self._live[request_id].moving

    def held(self, instance_id: int) -> int:
        """Live requests placed on `instance_id` (moving ones count on their source)."""
        return self._held[instance_id]

    def on(self, instance_id: int) -> list[RequestSpec]:
        """The requests placed on `instance_id` that are not migrating away, in start order:
        what a replacement of that instance must start again."""
        return [
            live.spec
            for live in self._live.values()
            if live.instance_id == instance_id and not live.moving
        ]

    def ids(self) -> list[str]:
        """Every live request, in start order."""
        return list(self._live)

    def __len__(self) -> int:
        return len(self._live)

    # ---- changes -------------------------------------------------------------------------
    def start(self, spec: RequestSpec, instance_id: int) -> None:
        self._live[spec.request_id] = LiveRequest(spec, None)
        self.place(spec.request_id, instance_id)

    def place(self, request_id: str, instance_id: int) -> None:
        live = self._live[request_id]
        self._unplace(live)
        live.instance_id = instance_id
        live.moving = False
        self._held[instance_id] += 1

    def park(self, request_id: str) -> None:
        self._unplace(self._live[request_id])

    def moving(self, request_id: str, moving: bool = True) -> None:
        self._live[request_id].moving = moving

    def finish(self, request_id: str) -> RequestSpec | None:
        """Accept a request's completion; None when it is not live (done already)."""
        live = self._live.pop(request_id, None)
        if live is None:
            return None
        self._unplace(live)
        return live.spec

    def _unplace(self, live: LiveRequest) -> None:
        if live.instance_id is not None:
            self._held[live.instance_id] -= 1
            live.instance_id = None
