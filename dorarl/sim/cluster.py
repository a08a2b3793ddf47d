"""The simulated machinery: cost-model instances and trainer on a virtual clock.

It is the simulator's `Executor` (each command changes instance state and schedules its
answer on the clock) and its event source (`poll` pops the next due item and hands what
happened to the driver). A strict executor: a command a real runtime could not honour
(dispatch to a busy or wrong-version instance, a weight load on an instance that still
holds requests or serves a peer, or that would hold more versions than it may, training at
the wrong version) raises `ProtocolError`.
Multi-turn episodes (`episodes`): at each turn's end a request parks (`EnvWaiting`) until
its environment answers, after a seeded latency; then it runs its next turn (`EnvAnswered`)
or, after its last, finishes. An answer that finds it moving or interrupted is carried out
where it lands or resumes.
Deterministic: ties on the clock pop in push order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dorarl.controller import (
    TRAINER,
    Command,
    ControllerConfig,
    Dispatch,
    EnvAnswered,
    EnvWaiting,
    InstanceStats,
    Interrupt,
    LoadWeights,
    Migrate,
    Offload,
    ProtocolError,
    ReleaseVersion,
    Resume,
    Timer,
    TrainDone,
    WeightsLoaded,
)
from dorarl.data import Group
from dorarl.driver import Driver, RequestSpec
from dorarl.record import Recorder
from dorarl.sim.clock import EventQueue
from dorarl.sim.cost import CostModel
from dorarl.sim.episodes import EpisodeModel
from dorarl.sim.instance import SimInstance, SimRequest
from dorarl.sim.rewards import RewardModel
from dorarl.sim.samples import sample_of


@dataclass(frozen=True, slots=True)
class _Wake:
    instance_id: int
    epoch: int


@dataclass(frozen=True, slots=True)
class _EnvAnswer:
    request_id: str


@dataclass(frozen=True, slots=True)
class _Arrival:
    request_ids: tuple[str, ...]
    src: int
    dst: int


class SimCluster:
    def __init__(
        self,
        config: ControllerConfig,
        cost: CostModel,
        prompt_len: int,
        recorder: Recorder,
        driver: Driver,
        rewards: RewardModel | None = None,
        seed: int = 0,
        episodes: EpisodeModel | None = None,
    ) -> None:
        self.config, self.cost, self.prompt_len = config, cost, prompt_len
        self.recorder = recorder
        self.driver = driver  # where answers go
        self.rewards, self.seed = rewards or RewardModel(), seed
        self.episodes = episodes
        # requests an instance may hold: without episodes no request waits, so the slots
        self.max_held = config.max_held if episodes is not None else config.slots
        threshold = config.orchestrator.kv_offload_threshold
        self.instances = [
            SimInstance(i, cost, config.slots, threshold) for i in range(config.instances)
        ]
        for inst in self.instances:
            inst.version = config.initial_version
            inst.weights_held = {config.initial_version}
        self.queue = EventQueue()
        self.now = 0.0
        self.pending = 0  # queued items other than timers: none left and not done is a deadlock
        self.published = config.initial_version
        self._links: dict[int, float] = {}  # weight source -> busy until
        self._interrupted: dict[str, SimRequest] = {}
        self._transit: dict[str, SimRequest] = {}

    # ---- the clock -----------------------------------------------------------------------
    def poll(self) -> None:
        """Advance to the next due item and hand what happened to the driver."""
        at, item = self.queue.pop()
        if not isinstance(item, Timer):
            self.pending -= 1
        self.now = at
        if isinstance(item, _Wake):
            self._on_wake(item)
        elif isinstance(item, _Arrival):
            self._on_arrival(item)
        elif isinstance(item, _EnvAnswer):
            self._on_env_answer(item.request_id)
        elif isinstance(item, WeightsLoaded):
            inst = self.instances[item.instance_id]
            inst.version, inst.ready = item.version, True
            inst.cached_prompts.clear()  # the old version's prefix blocks are freed
            self.driver.deliver(item)
        elif isinstance(item, TrainDone):
            self.published = item.new_version
            self.driver.train_done(item)
        else:
            self.driver.deliver(item)

    def known_requests(self) -> set[str]:
        """Every request this machinery holds (running, offloaded, parked or in transit)."""
        known = set(self._interrupted) | set(self._transit)
        for inst in self.instances:
            known.update(inst.active, inst.offloaded, inst.parked)
        return known

    def _reward(self, req: SimRequest) -> float:
        rewards = self.rewards.group_rewards(self.seed, req.group_id, self.config.group_size)
        return rewards[req.sample_index]

    def _push(self, at: float, item: Any) -> None:
        if not isinstance(item, Timer):
            self.pending += 1
        self.queue.push(at, item)

    def _touch(self, inst: SimInstance) -> None:
        inst.epoch += 1
        at = inst.next_wake()
        if at is not None:
            self._push(at, _Wake(inst.instance_id, inst.epoch))

    # ---- instance events -----------------------------------------------------------------
    def _on_wake(self, wake: _Wake) -> None:
        inst = self.instances[wake.instance_id]
        if wake.epoch != inst.epoch:
            return
        inst.advance(self.now)
        for req in inst.pop_finished():
            if self.episodes is not None:
                self._turn_ended(inst, req)
            else:
                self._finish(inst, req)
        self._kv_housekeeping(inst)
        self._touch(inst)

    def _finish(self, inst: SimInstance, req: SimRequest) -> None:
        sample = sample_of(req, req.prompt_index, self._reward(req))
        self.driver.sample_done(inst.instance_id, sample)

    # ---- multi-turn episodes ---------------------------------------------------------------
    def _turn_ended(self, inst: SimInstance, req: SimRequest) -> None:
        """The episode parks, keeping its KV, while its environment works on the turn."""
        assert self.episodes is not None
        req.turns_done += 1
        req.waiting = True
        inst.park(req)
        latency = self.episodes.latency(self.seed, req.group_id, req.sample_index, req.turns_done)
        self._push(self.now + latency, _EnvAnswer(req.rid))
        self.driver.deliver(EnvWaiting(req.group_id, req.sample_index, self.now))

    def _on_env_answer(self, rid: str) -> None:
        """Next turn or the end, where the episode is parked; one moving or interrupted
        gets its answer where it lands or resumes."""
        inst = next((i for i in self.instances if rid in i.parked), None)
        if inst is None:
            req = self._transit.get(rid) or self._interrupted.get(rid)
            assert req is not None and req.waiting, f"an answer for {rid}, which is nowhere"
            req.answered = True
            return
        inst.advance(self.now)
        req = inst.parked[rid]
        req.waiting = req.answered = False
        if req.last_turn:
            self._finish(inst, inst.unpark(rid))
        else:
            if req.on_host:  # restored when there is room, like an offloaded request
                inst.offloaded[rid] = inst.unpark(rid)
            self._kv_housekeeping(inst)
            self._touch(inst)
            self.driver.deliver(EnvAnswered(req.group_id, req.sample_index, self.now))

    def _land(self, inst: SimInstance, req: SimRequest) -> None:
        """A request arriving or resumed on `inst`: an episode waiting for its environment
        parks (its answer, if it came meanwhile, is carried out now); others run."""
        if req.waiting:
            req.on_host = False
            inst.park(req)
            if req.answered:
                self._push(self.now, _EnvAnswer(req.rid))
        else:
            inst.join(req)

    def _kv_housekeeping(self, inst: SimInstance) -> None:
        """Report threshold crossings, offload at the hard cap, restore when room returns."""
        resident = inst.resident()
        above = resident >= inst.kv_limit - 1e-6 * inst.kv_cap
        if above != inst.kv_above:
            inst.kv_above = above
            frac = resident / inst.kv_cap
            self._push(
                self.now, InstanceStats(inst.instance_id, len(inst.active), 0, frac, self.now)
            )
        if inst.kv_above and resident >= inst.kv_cap - 1e-6 * inst.kv_cap:
            self._relieve(inst)  # the engine's safety net
        while inst.offloaded and inst.can_restore():
            req = inst.offloaded.pop(next(iter(inst.offloaded)))
            inst.stall(self.now, self.cost.host_transfer_s(req.context))
            inst.join(req)
        while (req := inst.ready_parked()) is not None:
            inst.join(inst.unpark(req.rid))

    def _relieve(self, inst: SimInstance) -> None:
        """At the pool's end the engine offloads parked KV first (waiting episodes', then
        answered ones'), then the youngest running request's, keeping one running."""
        parked = sorted(
            (r for r in inst.parked.values() if not r.on_host), key=lambda r: not r.waiting
        )
        if parked:
            self._park_on_host(inst, parked[0].rid)
        elif len(inst.active) >= 2:
            self._offload_request(inst, next(reversed(inst.active)))

    def _park_on_host(self, inst: SimInstance, rid: str) -> None:
        """A parked episode's KV goes to host memory: one still waiting stays parked there,
        one answered waits for room with the offloaded requests."""
        req = inst.parked[rid]
        req.offloads += 1
        if req.waiting:
            inst.to_host(rid)
        else:
            inst.offloaded[rid] = inst.unpark(rid)
        inst.stall(self.now, self.cost.host_transfer_s(req.context))

    def _on_arrival(self, arrival: _Arrival) -> None:
        dst = self.instances[arrival.dst]
        # an empty arrival (every named request had finished first) may find dst moved on
        if arrival.request_ids and not dst.ready:
            raise ProtocolError(
                f"instance {dst.instance_id} changed version while requests migrated in"
            )
        dst.advance(self.now)
        for rid in arrival.request_ids:
            req = self._transit.pop(rid)
            dst.incoming_waiting -= req.waiting
            self._land(dst, req)
        dst.incoming -= len(arrival.request_ids)
        self._kv_housekeeping(dst)
        self._touch(dst)
        moved = arrival.request_ids
        self.driver.migration_done(arrival.src, arrival.dst, moved, moved)

    # ---- commands (Executor) -------------------------------------------------------------
    def dispatch(self, c: Dispatch, requests: list[RequestSpec]) -> None:
        inst = self._serving(c.instance_id, c.version, len(requests), c)
        if inst.holding - inst.env_waiting + len(requests) > inst.slots:
            raise ProtocolError(f"{c}: instance {c.instance_id} would exceed {inst.slots} slots")
        inst.advance(self.now)
        self._prefill(inst, c.group_id, [self.prompt_len] * len(requests))
        for spec in requests:
            target = spec.target_len
            assert target is not None, "the simulator always forces response lengths"
            req = SimRequest(
                spec.request_id,
                spec.group_id,
                spec.sample_index,
                self.prompt_len,
                target,
                segments=[(c.version, 0)],
                prompt_index=spec.prompt_index,
                turn_ends=self._turn_ends(spec, target),
            )
            inst.join(req)
        self._touch(inst)

    def load_weights(self, c: LoadWeights) -> None:
        inst = self.instances[c.instance_id]
        several = self.config.versions_per_instance > 1
        if (inst.holding and not several) or self._links.get(inst.instance_id, 0.0) > self.now:
            raise ProtocolError(f"{c}: instance still holds requests or serves weights")
        self._check_source(c)
        self._check_room(inst, c)
        inst.ready = False
        # several versions: the held requests keep their KV and decode on through the load
        free_cache = 0.0 if several and inst.holding else self.cost.free_cache_s
        start = max(self.now, inst.busy_until) + free_cache
        begin = max(start, self._links.get(c.source, 0.0))
        end = begin + self.cost.weight_load_s(from_trainer=c.source == TRAINER)
        self._links[c.source] = end
        self.recorder.overhead("free_cache", free_cache)
        self.recorder.overhead("load_balance", end - begin)
        self._push(end, WeightsLoaded(c.instance_id, c.version, end))

    def _check_room(self, inst: SimInstance, c: LoadWeights) -> None:
        """Its requests' versions stay resident beside the new one, within the bound."""
        if self.config.versions_per_instance == 1:  # a load replaces the weights
            inst.weights_held = {c.version}
            return
        held = self._held_versions(inst)
        if not held <= inst.weights_held:
            raise ProtocolError(
                f"{c}: requests of v{sorted(held - inst.weights_held)} lost weights"
            )
        inst.weights_held.add(c.version)  # beside what is not released yet
        if len(inst.weights_held) > self.config.versions_per_instance:
            raise ProtocolError(f"{c}: instance would hold versions {sorted(inst.weights_held)}")

    def _held_versions(self, inst: SimInstance) -> set[int]:
        """The versions of the requests it runs (none migrate in while it loads: the
        controller never switches an instance with incoming requests)."""
        held = (*inst.active.values(), *inst.offloaded.values(), *inst.parked.values())
        return {r.segments[-1][0] for r in held}

    def release_version(self, c: ReleaseVersion) -> None:
        inst = self.instances[c.instance_id]
        if c.version in self._held_versions(inst):
            raise ProtocolError(f"{c}: instance {c.instance_id} still serves v{c.version}")
        inst.weights_held.discard(c.version)

    def _check_source(self, c: LoadWeights) -> None:
        if c.source == TRAINER:
            if c.version != self.published:
                raise ProtocolError(f"{c}: the trainer holds v{self.published}")
            return
        peer = self.instances[c.source]
        if not peer.ready or peer.version != c.version:
            raise ProtocolError(f"{c}: peer {c.source} does not host v{c.version}")

    def migrate(self, c: Migrate) -> None:
        src, dst = self.instances[c.src], self.instances[c.dst]
        if not dst.ready or dst.version != src.version:
            raise ProtocolError(f"{c}: destination does not host v{src.version}")
        src.advance(self.now)
        moved = [
            self._take(src, rid)
            for rid in c.request_ids
            if rid in src.active or rid in src.offloaded or rid in src.parked
        ]
        if dst.holding + len(moved) > self.max_held:
            raise ProtocolError(f"{c}: destination has no room")
        duration = self.cost.migration_s(sum(r.context for r in moved))
        for req in moved:
            req.migrations += 1
            self._transit[req.rid] = req
        src.busy_until = max(src.busy_until, self.now) + duration
        dst.incoming += len(moved)
        dst.incoming_waiting += sum(r.waiting for r in moved)
        self.recorder.overhead("request_transfer", duration)
        self._push(self.now + duration, _Arrival(tuple(r.rid for r in moved), c.src, c.dst))
        self._touch(src)

    def interrupt(self, c: Interrupt) -> None:
        inst = self.instances[c.instance_id]
        inst.advance(self.now)
        for rid in c.request_ids:
            if rid in inst.active or rid in inst.offloaded or rid in inst.parked:
                self._interrupted[rid] = self._take(inst, rid)
        self._touch(inst)

    def resume(self, c: Resume) -> None:
        inst = self._serving(c.instance_id, c.version, len(c.request_ids), c)
        inst.advance(self.now)
        groups: dict[int, list[int]] = {}  # each group's contexts: its prompt is shared
        for rid in c.request_ids:
            req = self._interrupted.pop(rid)
            tokens = int(round(req.context))
            if req.segments[-1][0] != c.version:
                req.segments.append((c.version, int(round(req.gen))))
            groups.setdefault(req.group_id, []).append(tokens)
            self.recorder.reprefill(tokens)
            self._land(inst, req)
        for group_id, contexts in groups.items():
            self._prefill(inst, group_id, contexts)
        self._kv_housekeeping(inst)
        self._touch(inst)

    def _prefill(self, inst: SimInstance, group_id: int, contexts: list[int]) -> None:
        """Requests of one group's prompt placed together stall the instance for their
        prefill; with the prefix cache the instance keeps the prompt for the group's later
        requests until its version changes (prompt KV is small beside the responses', so
        its eviction is not modelled)."""
        cached = group_id in inst.cached_prompts
        computed = self.cost.prefill_tokens(self.prompt_len, contexts, cached)
        inst.stall(self.now, self.cost.prefill_s(computed))
        if self.cost.prefix_cache:
            inst.cached_prompts.add(group_id)
        self.recorder.prefill(inst.instance_id, computed, sum(contexts) - computed, 0)

    def offload(self, c: Offload) -> None:
        inst = self.instances[c.instance_id]
        inst.advance(self.now)
        if c.request_id in inst.active and len(inst.active) >= 2:
            self._offload_request(inst, c.request_id)
        elif c.request_id in inst.parked:
            self._park_on_host(inst, c.request_id)
        self._touch(inst)

    def _offload_request(self, inst: SimInstance, rid: str) -> None:
        req = inst.leave(rid)
        req.offloads += 1
        inst.offloaded[rid] = req
        inst.stall(self.now, self.cost.host_transfer_s(req.context))

    def train(self, version: int, groups: list[Group]) -> None:
        if self.published != version:
            raise ProtocolError(f"Train(v{version}): the trainer is at v{self.published}")
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for g in groups for s in g.samples)
        end = self.now + self.cost.train_s(tokens)
        self._push(end, TrainDone(version + 1, end))

    def set_timer(self, at: float) -> None:
        at = max(at, self.now)
        self._push(at, Timer(at))

    # ---- helpers -------------------------------------------------------------------------
    def _turn_ends(self, spec: RequestSpec, length: int) -> list[int]:
        if self.episodes is None:
            return []
        return self.episodes.turn_ends(self.seed, spec.group_id, spec.sample_index, length)

    def _serving(self, iid: int, version: int, extra: int, c: Command) -> SimInstance:
        inst = self.instances[iid]
        if not inst.ready or inst.version != version:
            raise ProtocolError(f"{c}: instance {iid} is not serving v{version}")
        if inst.holding + extra > self.max_held:
            raise ProtocolError(f"{c}: instance {iid} would hold over {self.max_held} requests")
        return inst

    def _take(self, inst: SimInstance, rid: str) -> SimRequest:
        if rid in inst.offloaded:
            return inst.offloaded.pop(rid)
        if rid in inst.parked:
            return inst.unpark(rid)
        return inst.leave(rid)
