"""Replacing a dead engine instance mid-run, so a lost actor costs time, not the run.

The runtime hands here every engine call that failed because an actor is gone, and every
answer that came from an actor replaced since (`EngineFleet.stale`). The controller never
notices: the instance keeps its version and its requests. A fresh actor takes the dead
one's place (a new incarnation), takes back the version the controller has it host and
any older ones it holds for requests still running there (the trainer's copy, kept for
every window version, or a live peer's), and starts the
requests the driver has placed on it again from their prompts. Each request's sampling
seed is its own, so under the same version they follow the same distribution as before;
the group still has one version. Then the failed call's effect is redone:

- a stepping burst (`run`): nothing to redo; its finished requests, if any, were started
  again with the others, and a stale report is dropped whole, so none is reported twice;
- a call read only for its failure (requests added, an observation sent): nothing to
  redo, the replacement started the instance's requests again;
- a weight load: loaded again on the destination's current actor, from a live copy;
- a migration: its snapshots outlive a dead destination (the driver owns them), so they
  land on the replacement with their KV; if the source died before exporting, its
  requests start again on the destination from their prompts. Requests that finished on
  the source first stay reported from there (`EngineFleet.on_migrated`).

The trainer dying (dorarl.runtime.recovery.trainer_recovery), an engine raising (a bug, not a lost
process), partial rollout (its parked requests' snapshots may be gone), or more restarts
than allowed stop the run instead. Uses the fleet's, the driver's and the controller's
public views only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import ray

from dorarl.driver import Driver
from dorarl.runtime.calls import (
    DEATHS,
    Call,
    EngineCall,
    LoadCall,
    MigrateCall,
    RestoreCall,
    RunCall,
    SendCall,
)
from dorarl.runtime.engines import EngineFleet

log = logging.getLogger(__name__)


class InstanceRecovery:
    def __init__(
        self,
        fleet: EngineFleet,
        driver: Driver,
        respawn: Callable[[int], Any],
        max_restarts: int,
    ) -> None:
        self.fleet, self.driver = fleet, driver
        self.respawn = respawn
        self.max_restarts = max_restarts
        self.restarts = 0

    def recoverable(self, call: Call, exc: Exception) -> bool:
        return (
            isinstance(call, EngineCall)
            and isinstance(exc, DEATHS)
            and self.driver.config.mode != "partial_rollout"
        )

    def on_failure(self, call: EngineCall, cause: str = "") -> bool:
        """Replace the dead engines the failed call involved and redo its effect; False when
        the restart budget is spent (the caller stops the run). `cause`: why it died, one
        line (dorarl.runtime.death_cause)."""
        for iid in call.engines:
            if call.generations[iid] == self.fleet.generations[iid] and not self.fleet.alive(iid):
                if self.restarts >= self.max_restarts:
                    return False
                self._restart(iid, cause or "cause unknown")
        self.redo(call)
        return True

    def on_restore_failed(self, call: RestoreCall, why: str) -> bool:
        """A replacement could not take a version back: it holds weights it was not meant to
        serve, and requests started on it may already run on them, so it is replaced in
        turn (its restart counted); False when the restart budget is spent."""
        if call.generations[call.iid] != self.fleet.generations[call.iid]:
            return True  # replaced since: the new actor takes its versions back itself
        if self.restarts >= self.max_restarts:
            return False
        ray.kill(self.fleet.workers[call.iid], no_restart=True)
        self._restart(call.iid, f"taking version {call.version} back failed: {why}")
        return True

    def redo(self, call: EngineCall) -> None:
        """Redo the effect of `call`, which failed or was answered by a replaced actor."""
        match call:
            case RunCall():
                self.fleet.run_ended(call)
            case SendCall():  # the replacement started the instance's requests again
                pass
            case RestoreCall():  # its source died: the replacement is replaced as for any failure
                if not self.on_restore_failed(call, "its source died"):
                    raise RuntimeError(f"{call.worker}: its source died, no restart left")
            case LoadCall(iid=iid, version=version):
                self.fleet.load(iid, version, self._source(version, avoid=iid))
            case MigrateCall() if _exported(call):
                self.fleet.reimport(call)
            case MigrateCall():
                self.fleet.on_migrated([], call, source_lost=True)

    # ---- steps ---------------------------------------------------------------------------
    def _restart(self, iid: int, cause: str) -> None:
        self.restarts += 1
        log.warning(
            "engine instance %d died: %s; starting a replacement (restart %d of %d)",
            iid, cause, self.restarts, self.max_restarts,
        )  # fmt: skip
        self.driver.recorder.died(f"engine instance {iid}", cause, self.driver.now(), iid)
        self.fleet.replace(iid, self.respawn(iid))
        instance = self.driver.controller.instance(iid)
        hosted = instance.version if instance.ready else None
        # the versions its requests run under go back before them: older ones it held for
        # requests still running there, then the one it hosts (if its load had ended)
        for version in [*instance.held, *([] if hosted is None else [hosted])]:
            self.fleet.restore(iid, version, self._source(version, avoid=iid))
        # requests caught in a migration are the migration's to redo (`redo`)
        requests = self.driver.requests.on(iid)
        self.fleet.start(iid, requests, hosted, held=set(instance.held))
        self.driver.recorder.restarted(iid, len(requests), self.driver.now())

    def _source(self, version: int, avoid: int) -> int:
        """The trainer if it still serves `version`, else a live peer that hosts it."""
        return self.fleet.holder(version, avoid, live=True)


def _exported(call: MigrateCall) -> bool:
    """Whether the migration's export ran (its snapshots exist): blocks until the source
    has run it, or raises for a source that died first."""
    try:
        ray.get(call.exported)
    except ray.exceptions.RayError:
        return False
    return True
