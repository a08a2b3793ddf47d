"""The controller's ledger: groups, requests, instances and the counters derived from them.

Every mutation goes through a method here so the derived counters (outstanding groups per
version, free slots per version on ready instances, instances per version) stay exact.
A request always sits on exactly one instance until its SampleDone; a group is outstanding
from its first Dispatch until a Train consumes it or, complete with all-equal rewards under
dynamic sampling, it is filtered; never both (`consume` and `filter` pop it from `groups`).
With several versions per instance, an instance that takes a newer version keeps its live
requests under their own: they are *held* (counted in `draining`, not in `requests_on`), and
when the last one of a version ends there the ledger notes a release for the controller.
A multi-turn episode waiting for its environment stays on its instance (its KV is there) but
takes no decode slot: an instance's free slots are its slots less the requests that are not
waiting, within `max_held` requests in all (`orchestrator.episode_overcommit` x slots).
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

from dorarl.controller.commands import request_id
from dorarl.controller.config import ControllerConfig
from dorarl.controller.errors import require


@dataclass(slots=True, eq=False)
class InstanceState:
    instance_id: int
    version: int
    ready: bool = True
    requests: dict[str, None] = field(default_factory=dict)  # placement order, oldest first
    incoming: int = 0  # requests migrating in
    serving: int = 0  # weight loads this instance is the source of
    source: int | None = None  # source of its own weight load; None while waiting for one
    kv_used_frac: float = 0.0
    # requests that fit under the KV threshold, from the last load report (None: no report
    # since the version was assigned); decode is KV-bound long before slots run out
    kv_fit: float | None = None
    offloaded: set[str] = field(default_factory=set)
    waiting: int = 0  # requests here waiting for their environment (no decode slot)
    # older versions whose requests still run here -> how many (several versions per instance)
    draining: dict[int, int] = field(default_factory=dict)

    @property
    def held_versions(self) -> list[int]:
        """The versions whose weights it must keep: older ones with requests here, then its own."""
        return [*sorted(self.draining), self.version]

    @property
    def pinned(self) -> bool:
        """Must keep its version for now (loading, receiving requests, or serving weights)."""
        return not self.ready or self.incoming > 0 or self.serving > 0


@dataclass(slots=True, eq=False)
class RequestState:
    group_id: int
    sample_index: int
    instance_id: int
    moving: bool = False
    parked: bool = False  # interrupted, waiting for Resume (partial rollout)
    relieved: bool = False  # already moved once for KV relief: never again (no ping-pong)
    held_as: int | None = None  # its version, once its instance has moved on to a newer one
    waiting: bool = False  # an episode between turns: its environment is working


@dataclass(slots=True, eq=False)
class GroupState:
    group_id: int
    prompt_index: int
    version: int
    remaining: int
    tokens: int = 0
    reward: float | None = None  # the first sample's reward
    mixed: bool = False  # some sample's reward differs from the first's

    def add_reward(self, reward: float) -> None:
        if self.reward is None:
            self.reward = reward
        elif reward != self.reward:
            self.mixed = True


class Ledger:
    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.slots = config.slots
        self.max_held = config.max_held  # requests an instance may hold, waiting ones included
        start = config.initial_version
        self.instances = [InstanceState(i, start) for i in range(config.instances)]
        self.groups: dict[int, GroupState] = {}
        self.requests: dict[str, RequestState] = {}
        self.out: dict[int, int] = defaultdict(int)
        self.done: dict[int, deque[int]] = defaultdict(deque)
        self.hosts: dict[int, dict[int, None]] = defaultdict(dict)  # assigned, ready or not
        self.requests_on: dict[int, int] = defaultdict(int)  # requests on instances of v
        self.free: dict[int, int] = defaultdict(int)  # free slots on ready instances of v
        self.buckets: dict[int, list[dict[int, None]]] = {}  # v -> free count -> ready instances
        self.sources: dict[int, dict[int, None]] = defaultdict(dict)  # ready, can serve weights
        self.awaiting: dict[int, None] = {}  # assigned, waiting for a weight source
        self.t = start  # version the next training step updates
        self.newest = start  # newest published version
        self.training = False
        self.steps_done = 0
        self.next_group = config.first_group
        self.next_prompt = config.first_prompt
        self.resume_prompts = deque(config.resume_prompts)  # first, before new prompts
        self.trainer_loads = 0
        self.dispatched = self.completed = self.consumed = self.filtered = 0
        self.carried = 0  # complete groups a stopped run left, queued again at the start
        self.stopping = False  # no new group, no new step: the run ends once drained
        self.filtered_since_publish = 0  # dynamic sampling's per-step budget in use
        self.releases: list[tuple[int, int]] = []  # (instance, version) none of its requests hold
        for inst in self.instances:
            self.hosts[start][inst.instance_id] = None
            self._index(inst)
            self._update_source(inst)

    # ---- queries -------------------------------------------------------------------------
    def running(self, version: int) -> int:
        return self.requests_on.get(version, 0)

    def most_free(self, version: int) -> InstanceState | None:
        """A ready instance of `version` with the most free slots (lowest id on ties)."""
        buckets = self.buckets.get(version, ())
        for free in range(len(buckets) - 1, 0, -1):
            if buckets[free]:
                return self.instances[min(buckets[free])]
        return None

    def open_instances(self, version: int) -> list[InstanceState]:
        """Ready instances of `version` with a free slot."""
        buckets = self.buckets.get(version, [])
        return [self.instances[i] for bucket in buckets[1:] for i in bucket]

    def waiting_on(self, version: int) -> int:
        """Requests on the instances of `version` that wait for their environment."""
        return sum(self.instances[i].waiting for i in self.hosts.get(version, ()))

    def done_counts(self) -> dict[int, int]:
        return {v: len(q) for v, q in self.done.items() if q}

    def out_counts(self) -> dict[int, int]:
        return {v: n for v, n in self.out.items() if n}

    def free_slots(self, inst: InstanceState) -> int:
        """Requests `inst` can take now: decode slots not held by a running request, within
        `max_held` requests in all. Episodes whose environment answered at once can hold more
        than the slots (the engine queues them), so it is clamped at 0."""
        held = len(inst.requests)
        return max(0, min(self.slots - (held - inst.waiting), self.max_held - held))

    def own_requests(self, inst: InstanceState) -> int:
        """Requests on `inst` of the version it hosts (not held ones of older versions)."""
        return len(inst.requests) - sum(inst.draining.values())

    def take_releases(self) -> list[tuple[int, int]]:
        """(instance, version) pairs whose last held request ended since the last call."""
        releases, self.releases = self.releases, []
        return releases

    @property
    def queued(self) -> int:
        """Complete groups waiting for a training step."""
        return self.completed + self.carried - self.consumed - self.filtered

    # ---- groups and requests -------------------------------------------------------------
    def new_group(self, version: int) -> GroupState:
        gid = self.next_group
        self.next_group += 1
        group = GroupState(
            gid, self._next_prompt_index(), version, remaining=self.config.group_size
        )
        self.groups[gid] = group
        self.out[version] += 1
        self.dispatched += 1
        return group

    def carry(self, group_id: int, prompt_index: int, version: int) -> None:
        """Queue a complete group a stopped run left (dispatched and completed there)."""
        require(group_id not in self.groups, f"carried group {group_id} is outstanding already")
        self.groups[group_id] = GroupState(group_id, prompt_index, version, remaining=0)
        self.out[version] += 1
        self.done[version].append(group_id)
        self.carried += 1

    def place(self, group: GroupState, inst: InstanceState, samples: range | tuple) -> None:
        require(
            inst.ready and inst.version == group.version,
            f"group {group.group_id} (v{group.version}) placed on instance {inst.instance_id} "
            f"(v{inst.version}, ready={inst.ready})",
        )
        for s in samples:
            rid = request_id(group.group_id, s)
            self.requests[rid] = RequestState(group.group_id, s, inst.instance_id)
            self._add(inst, rid)

    def _next_prompt_index(self) -> int:
        if self.resume_prompts:
            return self.resume_prompts.popleft()
        self.next_prompt += 1
        return self.next_prompt - 1

    def queued_groups(self) -> list[int]:
        """Complete groups waiting for a step, oldest version first, in completion order."""
        return [gid for version in sorted(self.done) for gid in self.done[version]]

    def untrained_prompts(self, skip: frozenset[int] = frozenset()) -> list[int]:
        """Prompt indices dispatched but not consumed (but those of the groups `skip`), then
        those not dispatched yet of the resume list: what a run resumed from a checkpoint
        taken now must dispatch first."""
        dispatched = [g.prompt_index for g in self.groups.values() if g.group_id not in skip]
        return dispatched + list(self.resume_prompts)

    def finish_sample(self, rid: str, tokens: int, reward: float = 0.0) -> GroupState | None:
        """Record a finished sample; returns its group when that completes the group, for
        the caller to `queue` it for training or `filter` it."""
        req = self.requests.pop(rid, None)
        if req is None:
            return None  # already finished (duplicate report)
        inst = self.instances[req.instance_id]
        if req.moving:
            inst.incoming -= 1
        self._remove(inst, rid, req)
        group = self.groups[req.group_id]
        group.remaining -= 1
        group.tokens += tokens
        group.add_reward(reward)
        if group.remaining:
            return None
        self.completed += 1
        return group

    def queue(self, group: GroupState) -> None:
        """A complete group waits for a training step (in its version's completion order)."""
        self.done[group.version].append(group.group_id)

    def filter(self, group: GroupState) -> None:
        """A complete group leaves without a training step (dynamic sampling): it is no
        longer outstanding, so it frees admission room and needs no step."""
        require(group.remaining == 0, f"group {group.group_id} filtered before it completed")
        del self.groups[group.group_id]
        self._leave(group.version)
        self.filtered += 1
        self.filtered_since_publish += 1

    def move(self, rid: str, dst: InstanceState) -> None:
        req = self.requests[rid]
        require(req.held_as is None, f"request {rid} of held v{req.held_as} moved")
        self._remove(self.instances[req.instance_id], rid, req)
        req.instance_id = dst.instance_id
        req.moving = True
        dst.incoming += 1
        self._add(dst, rid)

    def wait(self, rid: str, waiting: bool) -> bool:
        """An episode waits for its environment (True) or runs again (False); False when
        that changes nothing (an unknown request, or a repeated report)."""
        req = self.requests.get(rid)
        if req is None or req.waiting == waiting:
            return False
        inst = self.instances[req.instance_id]
        self._unindex(inst)
        req.waiting = waiting
        inst.waiting += 1 if waiting else -1
        self._index(inst)
        return True

    def arrived(self, rid: str) -> None:
        req = self.requests.get(rid)
        if req is not None and req.moving:
            req.moving = False
            self.instances[req.instance_id].incoming -= 1

    def start_training(self) -> int:
        """A training step on the batch just consumed starts: returns the version it updates."""
        version = self.t
        self.t += 1
        self.training = True
        return version

    def publish(self, version: int) -> None:
        """The training step in flight ended: `version` is the newest policy."""
        self.newest = version
        self.training = False
        self.steps_done += 1
        self.filtered_since_publish = 0

    def park(self, rid: str, parked: bool) -> None:
        """Partial rollout: an interrupted request waits (True) or runs again (False)."""
        self.requests[rid].parked = parked

    def relieve(self, rid: str, dst: InstanceState) -> None:
        """Move a request off an instance under KV pressure, once (it is marked relieved)."""
        self.move(rid, dst)
        self.requests[rid].relieved = True

    def offload(self, inst: InstanceState, rid: str) -> None:
        inst.offloaded.add(rid)

    def report_kv(self, inst: InstanceState, used_frac: float, fit: float | None) -> None:
        """An instance's KV usage (and, when it runs requests, how many fit the threshold);
        under the threshold its offloaded KV is back on the device."""
        inst.kv_used_frac = used_frac
        if fit is not None:
            inst.kv_fit = fit
        if used_frac < self.config.orchestrator.kv_offload_threshold:
            inst.offloaded.clear()

    def consume(self, group_ids: list[int]) -> None:
        for gid in group_ids:
            group = self.groups.pop(gid)
            # batches are picked from the head of each version's completion queue
            require(self.done[group.version][0] == gid, "batch not taken oldest first")
            self.done[group.version].popleft()
            self._leave(group.version)
        self.consumed += len(group_ids)

    def _leave(self, version: int) -> None:
        """One group of `version` is no longer outstanding."""
        self.out[version] -= 1
        if not self.out[version]:
            del self.out[version]
            self.done.pop(version, None)

    # ---- instances -----------------------------------------------------------------------
    def assign(self, inst: InstanceState, version: int) -> None:
        """Point an instance at another version. With one version per instance it must hold
        no live request; with several, its live requests are held under their own version
        (parked ones, partial rollout's, follow the instance)."""
        require(inst.ready or inst.source is None, "assign while a weight load is in flight")
        own = self.own_requests(inst)
        live = [
            r
            for r in inst.requests
            if not self.requests[r].parked and self.requests[r].held_as is None
        ]
        require(not live or self.config.versions_per_instance > 1, "assign with live requests")
        self._unindex(inst)
        self.sources[inst.version].pop(inst.instance_id, None)
        self.requests_on[inst.version] -= own
        self._hold(inst, live)
        if self.config.versions_per_instance > 1 and inst.version not in inst.draining:
            self.releases.append((inst.instance_id, inst.version))  # none of its requests use it
        self._unhost(inst)
        require(
            version not in inst.draining and len(inst.draining) < self.config.versions_per_instance,
            f"instance {inst.instance_id} holding {sorted(inst.draining)} assigned v{version}",
        )
        inst.version = version
        inst.ready = False
        if not inst.draining:  # held requests keep their KV, and their offloads stand
            inst.offloaded.clear()
            inst.kv_fit = None  # the switch frees the KV cache; the old mix says nothing
        self.hosts[version][inst.instance_id] = None
        self.requests_on[version] += own - len(live)
        self.awaiting[inst.instance_id] = None

    def _hold(self, inst: InstanceState, live: list[str]) -> None:
        """Keep `live` requests of the instance's version running under it as held ones."""
        for rid in live:
            self.requests[rid].held_as = inst.version
        if live:
            inst.draining[inst.version] = len(live)

    def start_load(self, inst: InstanceState, source: int) -> None:
        self.awaiting.pop(inst.instance_id, None)
        inst.source = source
        if source >= 0:
            self.instances[source].serving += 1
            self._update_source(self.instances[source])
        else:
            self.trainer_loads += 1

    def loaded(self, inst: InstanceState) -> None:
        if inst.source is not None and inst.source >= 0:
            self.instances[inst.source].serving -= 1
            self._update_source(self.instances[inst.source])
        elif inst.source is not None:
            self.trainer_loads -= 1
        inst.source = None
        inst.ready = True
        self._index(inst)
        self._update_source(inst)

    def _update_source(self, inst: InstanceState) -> None:
        if inst.ready and inst.serving < self.config.orchestrator.trainer_fanout:
            self.sources[inst.version][inst.instance_id] = None
        else:
            self.sources[inst.version].pop(inst.instance_id, None)

    def _unhost(self, inst: InstanceState) -> None:
        old = inst.version
        self.hosts[old].pop(inst.instance_id, None)
        if not self.hosts[old]:  # keep per-version maps as small as the window
            del self.hosts[old]
            require(not self.free.pop(old, 0), f"free slots left on unhosted version {old}")
            require(not self.requests_on.pop(old, 0), f"requests left on unhosted version {old}")
            self.buckets.pop(old, None)
            self.sources.pop(old, None)

    # ---- slot bookkeeping ----------------------------------------------------------------
    def _add(self, inst: InstanceState, rid: str) -> None:
        self._unindex(inst)
        inst.requests[rid] = None
        inst.waiting += self.requests[rid].waiting
        self.requests_on[inst.version] += 1
        self._index(inst)

    def _remove(self, inst: InstanceState, rid: str, req: RequestState) -> None:
        self._unindex(inst)
        del inst.requests[rid]
        inst.waiting -= req.waiting
        inst.offloaded.discard(rid)
        if req.held_as is None:
            self.requests_on[inst.version] -= 1
        else:
            self._unhold(inst, req.held_as)
        self._index(inst)

    def _unhold(self, inst: InstanceState, version: int) -> None:
        inst.draining[version] -= 1
        if not inst.draining[version]:
            del inst.draining[version]
            self.releases.append((inst.instance_id, version))

    def _index(self, inst: InstanceState) -> None:
        """Count a ready instance's free slots and file it under its free count."""
        if not inst.ready:
            return
        free = self.free_slots(inst)
        self.free[inst.version] += free
        if inst.version not in self.buckets:
            self.buckets[inst.version] = [{} for _ in range(self.slots + 1)]
        self.buckets[inst.version][free][inst.instance_id] = None

    def _unindex(self, inst: InstanceState) -> None:
        if not inst.ready:
            return
        free = self.free_slots(inst)
        self.free[inst.version] -= free
        del self.buckets[inst.version][free][inst.instance_id]
