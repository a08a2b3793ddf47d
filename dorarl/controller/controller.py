"""The sans-IO controller: `handle(event) -> list[Command]`, nothing else (h11 style).

No clocks, threads, Ray or torch here; time arrives as `event.now`. Protocol guarantees,
with K the staleness bound and t the version the next training step updates:

Invariant (INV): for every published version w,
    out(<= w) <= (w + K - t + 1)^+ x TBS,
where out(<= w) counts outstanding (dispatched, not consumed) groups of version <= w.

- Dispatch keeps INV: a group goes out under w only if every prefix w' >= w stays within
  its capacity (`staleness.headroom`). Dispatch happens only on published versions, so w <= t.
- A step at t starts only when the oldest-first pick of TBS complete groups takes, for
  every w, at least need(w) = out(<= w) - (w + K - t) x TBS groups of version <= w
  (`staleness.batch_ready`). Since need(w) <= TBS by INV, oldest-first meets all needs as
  soon as enough of them are complete; after the step, t+1 satisfies INV again. For
  w = t - K the need is every remaining group of that version (docs/design.md section 5).
- Eq. 1: INV at t gives out(<= t-K-1) = 0, so a group consumed by step t has
  t - K <= w <= newest <= t, i.e. 0 <= t - w <= K. No group is ever removed otherwise.
- No deadlock: if the trainer is idle and not ready, either some group is in flight (its
  requests sit on instances of their own version, which never switch while holding a
  request: they migrate them first, to instances that keep the version; or, with several
  versions per instance, they keep running there under their own version) and will finish,
  or nothing is in flight and out < TBS <= RBS, so the newest version may admit a group
  ((K+1) x TBS capacity), every instance is free to host it, and the trainer holds it as a
  weight source. A busy trainer always answers TrainDone.
- Versions: instances host window versions (newest-K .. newest); work exists only there
  (INV), and out-of-window instances are re-assigned at the TrainDone that pushed them out.
- Multi-turn episodes: one waiting for its environment (`EnvWaiting` .. `EnvAnswered`)
  keeps its instance, version and KV but frees its decode slot; an instance holds at most
  `max_held` requests in all. Nothing above depends on slots, so every argument stands.
- Dynamic sampling (`rollout.filter_groups`, `filtering.py`): a complete group of equal
  rewards may be filtered instead of queued. It leaves `out` for good, which only lowers
  every prefix, so INV, admission and the batch rule above hold for what is trained, and
  every dispatched group is consumed once or filtered once, never both. At most
  `rollout.max_filtered_per_step` are filtered while one version is the newest; after that
  every completion is queued, so the no-deadlock argument applies unchanged.
- Stopping (`Stop`): no group is dispatched and no step starts after it, so INV holds as
  groups only complete; the run finishes once the step in flight and every request in
  flight have ended (or at the stop's deadline). The complete groups left queued are a
  checkpoint's to carry (`resume_state(carry=True)`); a resumed run queues them again at
  `Start` under their own versions, each admitted as a dispatch would be (INV), so its
  steps take them within the bound, or drops them (`DropGroup`) when its window or batch
  size leaves no room.
"""

from __future__ import annotations

import logging
from typing import Any

from dorarl.controller.commands import (
    Command,
    DropGroup,
    Finish,
    ReleaseVersion,
    SetTimer,
    Train,
    parse_request_id,
    request_id,
)
from dorarl.controller.config import ControllerConfig
from dorarl.controller.dora import DoraOrchestrator
from dorarl.controller.errors import require
from dorarl.controller.events import (
    CarriedGroup,
    EnvAnswered,
    EnvWaiting,
    Event,
    InstanceStats,
    MigrationDone,
    SampleDone,
    Start,
    Stop,
    Timer,
    TrainDone,
    WeightsLoaded,
)
from dorarl.controller.filtering import GroupFilter
from dorarl.controller.invariants import violations
from dorarl.controller.lockstep import LockstepOrchestrator
from dorarl.controller.orchestrator import Orchestrator
from dorarl.controller.partial import PartialRolloutOrchestrator
from dorarl.controller.partition import kv_fit
from dorarl.controller.rollout import RolloutManager
from dorarl.controller.staleness import batch_ready, select_batch
from dorarl.controller.state import InstanceState, Ledger
from dorarl.controller.views import InstanceView

log = logging.getLogger(__name__)

__all__ = ["Controller", "parse_request_id", "request_id"]


class Controller:
    def __init__(self, config: ControllerConfig) -> None:
        config.validate()
        for note in config.ignored_settings():
            log.warning("%s", note)
        self.config = config
        self.ledger = Ledger(config)
        self.rollout = RolloutManager(self.ledger)
        self.orchestrator = _make_orchestrator(config, self.ledger, self.rollout)
        self.filter = GroupFilter(self.ledger)
        self.finished = False
        self.stop_deadline = float("inf")  # once stopping: when requests still running are left
        self._handlers = {
            Start: self._on_start,
            Stop: self._on_stop,
            SampleDone: self._on_sample_done,
            EnvWaiting: self._on_env_waiting,
            EnvAnswered: self._on_env_answered,
            InstanceStats: self._on_stats,
            WeightsLoaded: self._on_loaded,
            MigrationDone: self._on_migrated,
            TrainDone: self._on_train_done,
            Timer: self._on_timer,
        }

    def handle(self, event: Event) -> list[Command]:
        """Consume one event; return the commands it calls for, in execution order."""
        if self.finished:
            return []
        commands = self._handlers[type(event)](event)
        # first: a version's weights go before a load on the same instance needs the room
        commands = [ReleaseVersion(i, v) for i, v in self.ledger.take_releases()] + commands
        if not self.finished:
            commands += self._maybe_train()
            if self.rollout.demand():
                commands += self.rollout.supplement(self.orchestrator.dispatch_versions())
            commands += self._maybe_stopped(event.now)
        return commands

    # ---- read-only views for runtimes and tests ------------------------------------------
    @property
    def version(self) -> int:
        """Newest published version."""
        return self.ledger.newest

    @property
    def training(self) -> bool:
        """A training step is in flight (its TrainDone not delivered yet)."""
        return self.ledger.training

    def instance_versions(self) -> dict[int, int]:
        """Instance id -> assigned version (hosted, or being loaded)."""
        return {i.instance_id: i.version for i in self.ledger.instances}

    def instance(self, instance_id: int) -> InstanceView:
        """What instance `instance_id` hosts or loads, and the requests placed on it."""
        return _view(self.ledger.instances[instance_id])

    def hosts(self, version: int) -> list[int]:
        """Instances that host `version` now (ready), lowest id first."""
        ledger = self.ledger
        return sorted(i for i in ledger.hosts.get(version, ()) if ledger.instances[i].ready)

    def requests_in_flight(self) -> dict[str, int]:
        """Every dispatched, unfinished request -> the instance it is placed on (or migrating
        to, or was interrupted on)."""
        return {rid: req.instance_id for rid, req in self.ledger.requests.items()}

    def violations(self) -> list[str]:
        """Breaches of the protocol invariants (`dorarl.controller.invariants`); empty when
        all hold. For tests and debugging: it recounts the whole ledger."""
        return violations(self.ledger)

    def counts(self) -> dict[str, int]:
        ledger = self.ledger
        return {
            "dispatched": ledger.dispatched,
            "completed": ledger.completed,
            "consumed": ledger.consumed,
            "filtered": ledger.filtered,
            "queued": ledger.queued,
            "carried": ledger.carried,
            "in_flight": ledger.dispatched - ledger.completed,
            "steps_started": ledger.t - self.config.initial_version,
            "steps_done": ledger.steps_done,
        }

    def resume_state(self, carry: bool = False) -> dict[str, Any]:
        """The data position of a checkpoint of version `t`, for `ControllerConfig`'s resume
        keys: prompts dispatched but not trained on come first in the resumed run. With
        `carry`, the complete groups queued now are kept whole instead (`carried_group_ids`,
        oldest version first, for `Start.carried`), and only the others' prompts come first.

        Valid when no training step is in flight, or when the one in flight has finished and
        its TrainDone is not delivered yet (the runtime checkpoints then, before the next
        step can be queued on the trainer).
        """
        ledger = self.ledger
        carried = ledger.queued_groups() if carry else []
        state: dict[str, Any] = {
            "version": ledger.t,
            "first_group": ledger.next_group,
            "first_prompt": ledger.next_prompt,
            "resume_prompts": ledger.untrained_prompts(frozenset(carried)),
        }
        return state | ({"carried_group_ids": carried} if carry else {})

    # ---- handlers -------------------------------------------------------------------------
    def _on_start(self, event: Start) -> list[Command]:
        return self._carry(event.carried) + self.orchestrator.on_start(event.now)

    def _carry(self, carried: tuple[CarriedGroup, ...]) -> list[Command]:
        """Queue a stopped run's complete groups again, each if admission has room for it
        under its version (as a dispatch of it would need: INV); the others are dropped."""
        dropped: list[Command] = []
        for group in sorted(carried, key=lambda g: g.version):
            if self.rollout.room(group.version) > 0:
                self.ledger.carry(group.group_id, group.prompt_index, group.version)
            else:
                reason = f"carried_beyond_staleness_K{self.config.effective_K}"
                dropped.append(DropGroup(group.group_id, group.version, reason))
        return dropped

    def _on_stop(self, event: Stop) -> list[Command]:
        self.ledger.stopping = True
        self.stop_deadline = event.deadline
        return [SetTimer(event.deadline)] if event.deadline < float("inf") else []

    def _maybe_stopped(self, now: float) -> list[Command]:
        """Stopping: Finish once no step and no request is in flight, or at the deadline."""
        ledger = self.ledger
        if not ledger.stopping:
            return []
        left = len(ledger.requests)
        if ledger.training or (left and now < self.stop_deadline):
            return []
        self.finished = True
        return [Finish(f"stopped at v{ledger.newest}, {left} requests left in flight")]

    def _on_sample_done(self, event: SampleDone) -> list[Command]:
        rid = request_id(event.group_id, event.sample_index)
        req = self.ledger.requests.get(rid)
        if req is None:
            return []
        inst = self.ledger.instances[req.instance_id]
        group = self.ledger.finish_sample(rid, event.num_tokens, event.reward)
        filtered = self.filter.complete(group) if group is not None else []
        commands = filtered + self.orchestrator.on_sample_done(inst)
        return commands + (self.orchestrator.on_group_filtered() if filtered else [])

    def _on_env_waiting(self, event: EnvWaiting) -> list[Command]:
        """Its decode slot is free (the supplement after every event fills it); its KV and
        its place stay, so nothing else changes: it keeps its instance and version."""
        self.ledger.wait(request_id(event.group_id, event.sample_index), True)
        return []

    def _on_env_answered(self, event: EnvAnswered) -> list[Command]:
        self.ledger.wait(request_id(event.group_id, event.sample_index), False)
        return []

    def _on_stats(self, event: InstanceStats) -> list[Command]:
        inst = self.ledger.instances[event.instance_id]
        threshold = self.config.orchestrator.kv_offload_threshold
        fit = None
        if event.running > 0 and event.kv_used_frac > 0:
            fit = kv_fit(event.running, event.kv_used_frac, threshold)
        self.ledger.report_kv(inst, event.kv_used_frac, fit)
        if event.kv_used_frac >= threshold and inst.ready:
            return self.orchestrator.on_kv_pressure(inst)
        return []

    def _on_loaded(self, event: WeightsLoaded) -> list[Command]:
        inst = self.ledger.instances[event.instance_id]
        require(
            not inst.ready and inst.version == event.version,
            f"{event}: instance {inst.instance_id} was not loading v{event.version}",
        )
        self.ledger.loaded(inst)
        return self.orchestrator.on_loaded(inst) + self.orchestrator.start_loads()

    def _on_migrated(self, event: MigrationDone) -> list[Command]:
        for rid in event.request_ids:
            self.ledger.arrived(rid)
        return []

    def _on_train_done(self, event: TrainDone) -> list[Command]:
        ledger = self.ledger
        require(
            ledger.training and event.new_version == ledger.t,
            f"{event}: no training step to v{event.new_version} in flight",
        )
        ledger.publish(event.new_version)
        if ledger.stopping:  # no next step: the orchestrator moves nothing to the new version
            return []
        if ledger.newest >= self.config.steps:
            self.finished = True
            return [Finish(f"{ledger.steps_done} training steps done")]
        return self.orchestrator.on_train_done()

    def _on_timer(self, event: Timer) -> list[Command]:
        if self.ledger.stopping:
            return []
        return self.orchestrator.on_timer(event.now)

    def _maybe_train(self) -> list[Command]:
        ledger, cfg = self.ledger, self.config
        if ledger.training or ledger.t >= cfg.steps or ledger.stopping:
            return []
        if ledger.queued < cfg.tbs:
            return []
        out, done = ledger.out_counts(), ledger.done_counts()
        if not batch_ready(out, done, cfg.effective_K, ledger.t, cfg.tbs):
            return []
        group_ids = select_batch(ledger.done, cfg.tbs)
        ledger.consume(group_ids)
        version = ledger.start_training()
        return [Train(tuple(group_ids), version)] + self.orchestrator.on_train_started()


def _view(inst: InstanceState) -> InstanceView:
    return InstanceView(
        inst.instance_id, inst.version, inst.ready, tuple(inst.requests), tuple(inst.draining)
    )


def _make_orchestrator(
    config: ControllerConfig, ledger: Ledger, rollout: RolloutManager
) -> Orchestrator:
    if config.lockstep:
        return LockstepOrchestrator(ledger, rollout)
    if config.mode == "partial_rollout":
        return PartialRolloutOrchestrator(ledger, rollout)
    return DoraOrchestrator(ledger, rollout)
