"""Orchestrator base: the hooks a mode's policy answers, and the shared weight-load machinery.

A policy decides which instances change version and which versions receive new groups;
this base turns version changes into `LoadWeights` with P2P source choice. An instance
waiting for a source holds nothing and is retargeted to the newest version if one appears.
"""

from __future__ import annotations

from collections.abc import Iterable

from dorarl.controller.commands import Command, LoadWeights, Offload
from dorarl.controller.rollout import RolloutManager
from dorarl.controller.state import InstanceState, Ledger
from dorarl.controller.weights import choose_weight_source


class Orchestrator:
    def __init__(self, ledger: Ledger, rollout: RolloutManager) -> None:
        self.ledger = ledger
        self.rollout = rollout
        self.config = ledger.config

    # ---- hooks (a policy overrides what it needs) ---------------------------------------
    def on_start(self, now: float) -> list[Command]:
        return []

    def on_train_started(self) -> list[Command]:
        return []

    def on_train_done(self) -> list[Command]:
        return []

    def on_sample_done(self, inst: InstanceState) -> list[Command]:
        return []

    def on_loaded(self, inst: InstanceState) -> list[Command]:
        return []

    def on_group_filtered(self) -> list[Command]:
        """A group left without training (dynamic sampling): demand rose, a version's
        workload fell."""
        return []

    def on_timer(self, now: float) -> list[Command]:
        return []

    def on_kv_pressure(self, inst: InstanceState) -> list[Command]:
        return self.offload_youngest(inst)

    def dispatch_versions(self) -> list[int]:
        """Versions that may receive new groups now, most preferred first."""
        return [self.ledger.newest]

    # ---- shared machinery ----------------------------------------------------------------
    def switch(self, instances: Iterable[InstanceState], version: int) -> list[Command]:
        for inst in instances:
            self.ledger.assign(inst, version)
        return self.start_loads()

    def start_loads(self) -> list[Command]:
        """Issue LoadWeights for every waiting instance that can get a source now."""
        ledger = self.ledger
        holders: dict[int, dict[int, int]] = {}
        commands: list[Command] = []
        for iid in list(ledger.awaiting):
            inst = ledger.instances[iid]
            if inst.version < ledger.newest:
                ledger.assign(inst, ledger.newest)
            if inst.version not in holders:
                holders[inst.version] = self._holders(inst.version)
            peers = holders[inst.version]
            source = choose_weight_source(
                peers,
                trainer_has_version=inst.version == ledger.newest,
                trainer_busy=ledger.trainer_loads,
                fanout=self.config.orchestrator.trainer_fanout,
                p2p=self.config.orchestrator.p2p_weights,
            )
            if source is None:
                continue
            ledger.start_load(inst, source)
            if source in peers:
                peers[source] += 1
            commands.append(LoadWeights(iid, inst.version, source))
        return commands

    def offload_youngest(self, inst: InstanceState) -> list[Command]:
        """Offload the most recently placed active request, keeping one resident (none where
        the engines offload nothing: they manage their KV themselves)."""
        ledger = self.ledger
        if not self.config.orchestrator.engine_offload:
            return []
        active = [
            rid
            for rid in inst.requests
            if rid not in inst.offloaded
            and not ledger.requests[rid].moving
            and not ledger.requests[rid].parked
        ]
        if len(active) < 2:
            return []
        ledger.offload(inst, active[-1])
        return [Offload(inst.instance_id, active[-1])]

    def _holders(self, version: int) -> dict[int, int]:
        """Ready peers of `version` that can serve one more load, with their current loads."""
        ledger = self.ledger
        return {i: ledger.instances[i].serving for i in ledger.sources.get(version, ())}
