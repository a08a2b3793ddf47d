"""Replacing a dead engine instance mid-run, so a lost actor costs time, not the run.

The runtime hands a failed engine call here when the call's actor is gone (this module
uses the runtime's private helpers). The controller never notices: the instance keeps its
version and its requests. A fresh actor takes the dead one's place, loads that version (the
trainer's copy, which the runtime keeps for every window version, or a peer's) and starts
the requests that were on it again from their prompts. Each request's sampling seed is its
own, so under the same version they follow the same distribution as before; the group
still has one version. A migration that touched the dead actor restarts its requests on
the destination. The trainer dying, an engine raising (a bug, not a lost process), partial
rollout (its parked requests' snapshots may be gone), or more restarts than allowed stop
the run instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray

from dorarl.controller import MigrationDone

if TYPE_CHECKING:
    from dorarl.runtime.ray_runtime import RayRuntime, _Pending

log = logging.getLogger(__name__)

DEATHS = (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError)


class InstanceRecovery:
    def __init__(
        self, runtime: RayRuntime, respawn: Callable[[int], Any], max_restarts: int
    ) -> None:
        self.runtime = runtime
        self.respawn = respawn
        self.max_restarts = max_restarts
        self.restarts = 0
        self.epoch = [0] * runtime.config.instances

    def recoverable(self, job: _Pending, exc: Exception) -> bool:
        return (
            job.kind in ("run", "load", "migrate")
            and isinstance(exc, DEATHS)
            and self.runtime.config.mode != "partial_rollout"
        )

    def on_failure(self, job: _Pending) -> bool:
        """Replace the dead engines the failed call involved and redo its effect; False when
        the restart budget is spent (the caller stops the run)."""
        for iid in self._engines_of(job):
            if job.epoch[iid] == self.epoch[iid] and not self._alive(iid):
                if self.restarts >= self.max_restarts:
                    return False
                self._restart(iid)
        if job.kind == "load":
            self._redo_load(job)
        elif job.kind == "migrate":
            self._redo_migration(job)
        return True  # a failed "run" is re-queued by the restart

    # ---- steps ---------------------------------------------------------------------------
    def _engines_of(self, job: _Pending) -> list[int]:
        if job.kind == "run":
            return [job.args[0]]
        if job.kind == "load":
            iid, _, source = job.args
            return [iid] if source is None or source < 0 else [iid, source]
        return [job.args[0], job.args[1]]  # migrate: src, dst

    def _alive(self, iid: int) -> bool:
        try:
            ray.get(self.runtime.workers[iid].stats.remote(), timeout=30)
        except DEATHS:
            return False
        return True

    def _restart(self, iid: int) -> None:
        rt = self.runtime
        self.restarts += 1
        self.epoch[iid] += 1
        log.warning("engine instance %d died; starting a replacement (%d)", iid, self.restarts)
        rt.workers[iid] = self.respawn(iid)
        rt.running_call.pop(iid, None)
        inst = rt.controller.ledger.instances[iid]
        if inst.ready:  # it hosted a version: put it back before its requests
            rt.workers[iid].load_weights.remote(
                self._weights(inst.version, avoid=iid), inst.version
            )
        # requests caught in a migration restart on its destination (`_redo_migration`)
        requests = [
            rt.specs[rid]
            for rid, where in rt.where.items()
            if where == iid and rid not in rt.moving
        ]
        if requests:
            rt.workers[iid].add.remote(requests)
        rt.recorder.restarted(iid, len(requests), rt.now())
        rt._keep_running(iid)

    def _redo_load(self, job: _Pending) -> None:
        """The load's destination or its source died: load again from a live copy."""
        iid, version, _ = job.args
        rt = self.runtime
        weights = self._weights(version, avoid=iid)
        rt._submit(
            rt.workers[iid].load_weights.remote(weights, version), "load", iid, version, None
        )

    def _redo_migration(self, job: _Pending) -> None:
        """Requests caught in a move with a dead end start again on the destination."""
        rt = self.runtime
        src, dst, rids = job.args
        rt.moving.difference_update(rids)
        moved = [rid for rid in rids if rid in rt.specs]  # finished ones reported already
        if moved:
            rt.workers[dst].add.remote([rt.specs[rid] for rid in moved])
        for rid in moved:
            rt._place(rid, dst)
        rt._keep_running(dst)
        rt._deliver(MigrationDone(tuple(moved), src, dst, rt.now()))

    def _weights(self, version: int, avoid: int) -> Any:
        """The trainer's copy of `version` if the runtime still holds it, else a live peer's."""
        rt = self.runtime
        if version in rt.weights_ref:
            return rt.weights_ref[version]
        ledger = rt.controller.ledger
        for peer in ledger.hosts.get(version, {}):
            if peer != avoid and ledger.instances[peer].ready and self._alive(peer):
                return rt.workers[peer].weights.remote()
        raise RuntimeError(f"no live copy of version {version} to restore instance {avoid}")
