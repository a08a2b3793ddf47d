"""DORA policy (docs/design.md, section 4): versions side by side, partition, migration, tiers.

Re-balance triggers: a training step starting or ending (update-driven), an instance's KV
usage over the threshold (utilization), a periodic timer (temporal), plus a sample ending
on a legacy version (its dry instances go to the newest as the plan shrinks it). Each
cycle: partition plan (legacy versions packed as tight as their KV allows, not their
slots) -> release the cheapest instances of shrinking versions, moving their requests
(with KV) to instances that keep the version -> load the newest version onto released
instances from a peer when one holds it. With several versions per instance (LoRA
adapters) the cycle is simpler: every instance free to change takes the newest version
and keeps its requests running under their own, so nothing migrates.
"""

from __future__ import annotations

from dorarl.controller.commands import Command, Migrate, SetTimer
from dorarl.controller.migration import Candidate, choose_releases, plan_migrations
from dorarl.controller.orchestrator import Orchestrator
from dorarl.controller.partition import capacity_floor, packing_limit, plan_partition
from dorarl.controller.state import InstanceState


class DoraOrchestrator(Orchestrator):
    def on_start(self, now: float) -> list[Command]:
        return [SetTimer(now + self.config.orchestrator.rebalance_period_s)]

    def on_train_started(self) -> list[Command]:
        return self.rebalance()

    def on_train_done(self) -> list[Command]:
        return self.rebalance()

    def on_sample_done(self, inst: InstanceState) -> list[Command]:
        """Legacy instances that ran dry go to the newest version as far as the plan shrinks
        their version (the cheapest release there is: nothing to move). Every dry one of the
        version counts, not only `inst`: a sample done on a peer lowers the version's floor
        below instances kept when they ran dry, and left there the newest version can lack
        the slots of one group while they idle until the timer."""
        ledger, version = self.ledger, inst.version
        if self.holds_several or version == ledger.newest:
            return []
        hosts = [ledger.instances[i] for i in ledger.hosts[version]]
        dry = [h for h in hosts if not h.requests and not h.pinned]
        excess = len(hosts) - self.partition().get(version, 0) if dry else 0
        return self.switch(dry[:excess], ledger.newest) if excess > 0 else []

    def on_loaded(self, inst: InstanceState) -> list[Command]:
        """A load of an older version ended, or freed a source the window has left: re-plan."""
        ledger = self.ledger
        stale = min(ledger.hosts) < ledger.newest - self.config.effective_K
        # several versions: the load may have freed its source to take the newest
        changed = inst.version != ledger.newest or stale or self.holds_several
        return self.rebalance() if changed else []

    def on_group_filtered(self) -> list[Command]:
        """Re-plan: the filtered group's version may need none of its instances now, and
        those that ran dry earlier were kept for it; left there, the newest version can
        lack the slots of one group while they idle until the timer."""
        return self.rebalance()

    def on_timer(self, now: float) -> list[Command]:
        return self.rebalance() + [SetTimer(now + self.config.orchestrator.rebalance_period_s)]

    def on_kv_pressure(self, inst: InstanceState) -> list[Command]:
        return self.relieve(inst) + self.rebalance()

    def dispatch_versions(self) -> list[int]:
        """Newest first; then legacy versions (newest to oldest) for residual idle slots,
        only if a group dispatched now could still wait one more step (w + K >= t + 1),
        so a fresh group never holds up the very next step."""
        ledger, bound = self.ledger, self.config.effective_K
        versions = [ledger.newest]
        if self.config.orchestrator.legacy_fill:
            oldest = max(ledger.t + 1 - bound, 0)
            versions += [w for w in range(ledger.newest - 1, oldest - 1, -1) if ledger.hosts.get(w)]
        return versions

    @property
    def holds_several(self) -> bool:
        return self.config.versions_per_instance > 1

    # ---- re-balance cycle ----------------------------------------------------------------
    def rebalance(self) -> list[Command]:
        if self.holds_several:
            return self.advance_all()
        target = self.partition()
        commands: list[Command] = []
        released: list[InstanceState] = []
        for version in sorted(self.ledger.hosts):
            if version != self.ledger.newest:
                moves, freed = self._shrink(version, target.get(version, 0))
                commands += moves
                released += freed
        return commands + self.switch(released, self.ledger.newest)

    def advance_all(self) -> list[Command]:
        """Every instance behind the newest version and free to change takes it; its
        requests keep running under their own version. There is room: at a publish of n,
        Eq. 1 leaves work of versions n-K .. n-1 only, so an instance holds at most K+1
        (`ControllerConfig.versions_per_instance` is at least that)."""
        ledger = self.ledger
        behind = [i for i in ledger.instances if i.version < ledger.newest and not i.pinned]
        return self.switch(behind, ledger.newest)

    def partition(self) -> dict[int, int]:
        ledger = self.ledger
        running = {v: ledger.running(v) for v, hosts in ledger.hosts.items() if hosts}
        workload = {v: n for v, n in running.items() if n}
        demand = self.rollout.newest_demand() * self.config.group_size
        if demand:
            workload[ledger.newest] = workload.get(ledger.newest, 0) + demand
        floors = {v: self._floor(v, n) for v, n in running.items() if n}
        caps = {v: len(ledger.hosts[v]) for v in running if v != ledger.newest}
        return plan_partition(workload, floors, caps, ledger.newest, self.config.instances)

    def _floor(self, version: int, running: int) -> int:
        """Instances `version`'s requests need: a slot for each one not waiting for its
        environment, within `max_held` requests per instance.

        A legacy version holds the stragglers the trainer waits for. Packed by slots alone,
        they overflow the KV pool, and an offloaded request makes no progress until others
        finish; so (with `kv_packing`) a legacy version keeps as many instances as its
        decoding requests need at the count that fit under the KV threshold at the last
        reports (a waiting episode's KV is the first its engine offloads). It never grows:
        the floor is capped at its current instances (episodes answered at once may hold
        more than their slots there).
        """
        ledger, per = self.ledger, self.config.slots
        hosts = ledger.hosts[version]
        if version != ledger.newest and self.config.orchestrator.kv_packing:
            per = packing_limit(per, (ledger.instances[i].kv_fit for i in hosts))
        decoding = running - ledger.waiting_on(version)
        need = max(capacity_floor(decoding, per), capacity_floor(running, ledger.max_held))
        return min(len(hosts), need)

    def _shrink(self, version: int, target: int) -> tuple[list[Command], list[InstanceState]]:
        """Release instances of `version` down to `target`; move their requests to the rest."""
        ledger = self.ledger
        hosts = [ledger.instances[i] for i in ledger.hosts[version]]
        excess = len(hosts) - target
        if excess <= 0:
            return [], []
        cands = [
            Candidate(i.instance_id, len(i.requests), ledger.free_slots(i), i.ready, i.pinned)
            for i in hosts
        ]
        released = set(choose_releases(cands, excess))
        moving = {
            i.instance_id: list(i.requests)
            for i in hosts
            if i.instance_id in released and i.requests
        }
        keep_free = {
            i.instance_id: ledger.free_slots(i)
            for i in hosts
            if i.ready and i.instance_id not in released
        }
        commands: list[Command] = []
        for rids, src, dst in plan_migrations(moving, keep_free):
            for rid in rids:
                ledger.move(rid, ledger.instances[dst])
            commands.append(Migrate(rids, src, dst))
        return commands, [ledger.instances[i] for i in sorted(released)]

    # ---- KV pressure -----------------------------------------------------------------------
    def relieve(self, inst: InstanceState) -> list[Command]:
        """Move the youngest request to a same-version peer under the threshold, else offload.

        A request moves for relief at most once: the peer it lands on may cross the
        threshold in turn, and moving it back would bounce it forever without progress.
        """
        ledger = self.ledger
        threshold = self.config.orchestrator.kv_offload_threshold
        peers = [
            p
            for p in ledger.open_instances(inst.version)
            if p is not inst and p.kv_used_frac < threshold
        ]
        youngest = self._youngest_active(inst)
        if not peers or youngest is None or len(inst.requests) < 2:
            return self.offload_youngest(inst)
        dst = min(peers, key=lambda p: (p.kv_used_frac, -ledger.free_slots(p), p.instance_id))
        ledger.relieve(youngest, dst)
        return [Migrate((youngest,), inst.instance_id, dst.instance_id)]

    def _youngest_active(self, inst: InstanceState) -> str | None:
        for rid in reversed(inst.requests):
            req = self.ledger.requests[rid]
            held = req.held_as is not None  # its version lives on this instance only
            if not req.moving and not req.relieved and not held and rid not in inst.offloaded:
                return rid
        return None
