"""Lockstep policy for `sync` and `one_step_off` (docs/design.md, section 6): one version for all.

Instances switch together, only once no request is in flight anywhere, so the rollout of a
batch always waits for its slowest sample. New groups go out only when every instance is
ready at the newest version. With K=0 this is synchronous RL; with K=1 the next batch is
generated under v_n while the trainer works on batch n (one-step off-policy).
"""

from __future__ import annotations

from dorarl.controller.commands import Command
from dorarl.controller.orchestrator import Orchestrator
from dorarl.controller.state import InstanceState


class LockstepOrchestrator(Orchestrator):
    def on_train_done(self) -> list[Command]:
        return self.maybe_switch()

    def on_sample_done(self, inst: InstanceState) -> list[Command]:
        return [] if inst.requests else self.maybe_switch()

    def on_loaded(self, inst: InstanceState) -> list[Command]:
        return self.maybe_switch()

    def maybe_switch(self) -> list[Command]:
        ledger = self.ledger
        if ledger.requests:
            return []
        stale = [
            i for i in ledger.instances if i.ready and i.version < ledger.newest and i.serving == 0
        ]
        return self.switch(stale, ledger.newest)

    def dispatch_versions(self) -> list[int]:
        newest = self.ledger.newest
        if all(i.ready and i.version == newest for i in self.ledger.instances):
            return [newest]
        return []
