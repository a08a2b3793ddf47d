"""Partial-rollout policy (docs/design.md, section 6; AReaL/slime style): all follow the newest.

At each weight update every in-flight request is interrupted (KV dropped) and resumed on
the same instance under the new version by re-prefilling prompt + partial output, so a
trajectory mixes versions. Staleness bound: admission and batch selection use a group's
dispatch version, which is the version of its OLDEST token, so for every consumed sample
0 <= train_version - min(token versions) <= K and max(token versions) <= train_version.
"""

from __future__ import annotations

from dorarl.controller.commands import Command, Interrupt, Resume
from dorarl.controller.orchestrator import Orchestrator
from dorarl.controller.state import InstanceState


class PartialRolloutOrchestrator(Orchestrator):
    def on_train_done(self) -> list[Command]:
        return self.promote()

    def on_loaded(self, inst: InstanceState) -> list[Command]:
        commands = self.promote()
        if inst.ready and inst.version == self.ledger.newest:
            commands += self._resume(inst)
        return commands

    def promote(self) -> list[Command]:
        """Interrupt and switch every ready instance behind the newest version.

        An instance still serving weights to a peer waits for the next load to finish.
        """
        ledger = self.ledger
        commands: list[Command] = []
        stale = [
            i for i in ledger.instances if i.ready and i.version < ledger.newest and i.serving == 0
        ]
        for inst in stale:
            live = tuple(r for r in inst.requests if not ledger.requests[r].parked)
            for rid in live:
                ledger.park(rid, True)
            if live:
                commands.append(Interrupt(inst.instance_id, live))
        return commands + self.switch(stale, ledger.newest)

    def _resume(self, inst: InstanceState) -> list[Command]:
        parked = tuple(r for r in inst.requests if self.ledger.requests[r].parked)
        for rid in parked:
            self.ledger.park(rid, False)
        return [Resume(parked, inst.instance_id, inst.version)] if parked else []
