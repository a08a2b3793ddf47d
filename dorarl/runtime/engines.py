"""The engine actors as the Ray runtime's executor of rollout commands, and their answers.

Every command naming an instance becomes calls on its actor, which runs them one at a time
in submission order: that is the per-instance ordering the controller relies on. One
stepping call (`run`, `steps_per_call` engine steps) stays queued on every instance that
holds requests; its report brings finished requests (scored, to the driver), KV usage
crossings of the threshold (`InstanceStats`) and paced-compute figures. Weights travel
through the `WeightTransport`; a migration is an export on its source whose snapshots an
import on its destination takes, by reference. With the collective transport the snapshots'
KV stays out of them: the destination's import fetches it over the group from the source
(`WeightTransport.kv_route`, dorarl.runtime.transfer.kv_transfer).

Each instance has an incarnation (`generations`), raised when recovery replaces its dead
actor. A call's answer counts only if the actor it lands on is the incarnation it was
sent to (`stale`); recovery redoes the others. When a migration's source was replaced, the
requests it kept (finished there, their reports lost with it) start again on the
destination, so nothing is lost and nothing is reported twice.

Multi-turn episodes (`plan.episodes`): a dispatched episode reaches its engine when its
environment's reset answers, and a turn's end comes back in a run report like a finished
request; the environment answers on its own loop (`poll_envs`), and the first prompt or
the observation goes to the instance the request is on then (held back while it migrates
or is interrupted, and sent where it lands; one whose reset is out moves in the books
only). A waiting episode is held by its instance,
KV and all, but no stepping call is queued for it, and the controller's KV-pressure
relief sees it like any request there. The controller hears of each wait (`EnvWaiting`, at
the turn's end) and of its end (`EnvAnswered`: the next turn is sent to the engine, or
the episode starts again from its prompt), so a waiting episode's decode slot takes
another request. The engine holds the extra requests as they come (a waiting episode
keeps no slot there either; answered ones queue for a slot before fresh prompts).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import ray

from dorarl.controller import (
    TRAINER,
    Dispatch,
    EnvAnswered,
    EnvWaiting,
    InstanceStats,
    Interrupt,
    LoadWeights,
    Migrate,
    Offload,
    ReleaseVersion,
    Resume,
    WeightsLoaded,
    request_id,
)
from dorarl.data import NewSegment
from dorarl.driver import Driver, RequestSpec
from dorarl.engine.capabilities import DORARL_CAPABILITIES, Capabilities
from dorarl.record.pacing import PaceTally
from dorarl.runtime.calls import (
    ANSWER_WAIT_S,
    CallTable,
    EngineCall,
    LoadCall,
    MigrateCall,
    RestoreCall,
    RunCall,
    SendCall,
    lives,
)
from dorarl.runtime.rollout import RolloutPlan
from dorarl.runtime.transfer.weights import WeightTransport
from dorarl.runtime.workers.engine_worker import RunReport, WeightsReport

log = logging.getLogger(__name__)

STEPS_PER_CALL = 8
"""Engine steps per remote call: long enough to amortise the call, short enough to react."""


class EngineFleet:
    """The engine actors by instance id (`workers`: a replaced one is the new actor), the
    executor of the driver's rollout commands."""

    def __init__(
        self,
        driver: Driver,
        workers: Sequence[Any],
        calls: CallTable,
        weights: WeightTransport,
        plan: RolloutPlan,
        pace: PaceTally,
        *,
        steps_per_call: int = STEPS_PER_CALL,
        max_model_len: int = 1 << 30,
        capabilities: Capabilities = DORARL_CAPABILITIES,
    ) -> None:
        self.driver = driver  # where answers go; its clock is the runtime's
        self.workers = list(workers)
        self.generations = [0] * len(self.workers)  # incarnation of each instance's actor
        self.calls, self.weights, self.plan, self.pace = calls, weights, plan, pace
        self.now, self.recorder = driver.now, driver.recorder
        self.steps_per_call = steps_per_call
        self._running: dict[int, ray.ObjectRef] = {}  # instance -> its queued `run` call
        self._kv_above = [False] * len(self.workers)
        self._parked: dict[str, ray.ObjectRef] = {}  # interrupted request -> its abort's result
        self._env_waiting: set[str] = set()  # episodes the controller was told wait (EnvWaiting)
        # Episodes whose reset is out (not on their engine yet): the version override they
        # start under; each reaches its engine when its first prompt is in (poll_envs).
        self._resetting: dict[str, int | None] = {}
        # The env's answer (next observation ids, or None and why: the end) for a request
        # that is moving or interrupted, carried out where it lands or resumes.
        self._held_back: dict[str, tuple[list[int] | None, str | None]] = {}
        self.max_model_len = max_model_len
        self.capabilities = capabilities
        # A replacement's loads of the versions its instance held (`restore`), until each
        # lands: until then it holds none of them, so it serves no peer.
        self._restoring: dict[int, list[ray.ObjectRef]] = {}

    # ---- commands (the driver's Executor, engine part) ----------------------------------
    def dispatch(self, c: Dispatch, requests: list[RequestSpec]) -> None:
        self.start(c.instance_id, requests)

    def load_weights(self, c: LoadWeights) -> None:
        self.load(c.instance_id, c.version, c.source)

    def release_version(self, c: ReleaseVersion) -> None:
        """An older version none of the instance's requests use any more: its adapter goes
        (the engine keeps it should a request still run under it, and says so)."""
        ref = self.unload(c.instance_id, c.version)
        self._send(c.instance_id, f"releasing version {c.version}", ref)

    # ---- versions on an engine -------------------------------------------------------------
    def host_first(self, version: int, timeout_s: float) -> None:
        """Before the first command: every engine that does not hold the run's first
        `version` loads it from the trainer (engines holding adapters start on the base,
        version 0, so a LoRA run resumed at v gets v's adapter here); waited for at most
        `timeout_s`, and a failed load raises as the engine's."""
        workers = self.workers
        held = ray.get([w.resident_versions.remote() for w in workers], timeout=timeout_s)
        missing = [iid for iid, versions in enumerate(held) if version not in versions]
        if not missing:
            return
        loads = {iid: self._carry(iid, version, TRAINER) for iid in missing}
        ready, _ = ray.wait(list(loads.values()), num_returns=len(loads), timeout=timeout_s)
        for iid, ref in loads.items():
            if ref not in ready:
                raise TimeoutError(
                    f"engine instance {iid} did not load version {version} in {timeout_s:.0f}s "
                    "(weights.timeout_s)"
                )
            ray.get(ref)

    def unload(self, iid: int, version: int) -> ray.ObjectRef:
        """Ask `iid` to drop `version`'s adapter; after the calls sent to it before (an
        actor runs its calls in order), its answer is whether it went (False: a request
        there still runs under it, or it holds no such adapter)."""
        return self.workers[iid].unload_version.remote(version)

    def migrate(self, c: Migrate) -> None:
        src, dst = self.workers[c.src], self.workers[c.dst]
        # an engine exporting no KV hands over tokens: the destination re-prefills them
        route = self.weights.kv_route(src, dst) if self.capabilities.kv_export else None
        if route is None:  # snapshots and KV pickled through the object store
            ids, snapshots = src.export.options(num_returns=2).remote(list(c.request_ids))
            ref = dst.import_.remote(snapshots)
        else:  # metadata through Ray, KV over the group (dorarl.runtime.transfer.kv_transfer)
            ids, snapshots = src.export_kv.options(num_returns=2).remote(list(c.request_ids))
            ref = dst.import_parcel.remote(snapshots, src, *route)
        parcel = route is not None
        call = MigrateCall(c.src, c.dst, c.request_ids, ids, snapshots, parcel, **self._sent(ref))
        self.calls.submit(call)

    def interrupt(self, c: Interrupt) -> None:
        aborted = self.workers[c.instance_id].abort.remote(list(c.request_ids))
        for rid in c.request_ids:
            self._parked[rid] = aborted

    def resume(self, c: Resume) -> None:
        for rid in c.request_ids:  # not on the engine yet: it starts under the new version
            if rid in self._resetting:
                self._resetting[rid] = c.version
        refs = list(dict.fromkeys(self._parked.pop(rid) for rid in c.request_ids))
        worker = self.workers[c.instance_id]
        ref = worker.resume.remote(list(c.request_ids), *refs, version=c.version)
        self._send(c.instance_id, "resuming requests", ref)
        self._release_held_back(c.request_ids)
        self.keep_running(c.instance_id)

    def offload(self, c: Offload) -> None:
        ref = self.workers[c.instance_id].offload.remote(c.request_id)
        self._send(c.instance_id, "offloading a request", ref)

    # ---- what recovery and the commands share -------------------------------------------
    def start(
        self,
        iid: int,
        requests: Sequence[RequestSpec],
        version: int | None = None,
        held: set[int] | frozenset[int] = frozenset(),
    ) -> None:
        """Start `requests` on `iid` from their prompts (placed there by the driver), each
        under the version it was dispatched under, or all under `version` (a replacement
        restarting them under what its instance hosts, as full weights would) but those of
        an older version it `held` for them, which keep theirs."""
        if requests:
            versions = [None if spec.version in held else version for spec in requests]
            if self.plan.episodes is None:
                ref = self.workers[iid].add.remote(self.plan.requests(requests, versions))
                self._send(iid, "adding requests", ref)
            else:
                self._reset(requests, versions)
        self.keep_running(iid)

    def _reset(self, specs: Sequence[RequestSpec], versions: Sequence[int | None]) -> None:
        """Start (again) an episode for each of `specs`: a fresh env, its reset out on the
        env loop; the request reaches its engine when its first prompt is in. A reset is
        the env's work, so one still out at the next poll frees its decode slot
        (EnvWaiting) as a wait between turns does."""
        for spec, version in zip(specs, versions, strict=True):
            rid = spec.request_id
            self._held_back.pop(rid, None)
            self._resetting[rid] = version
        self.plan.begin_episodes(specs)

    def load(self, iid: int, version: int, source: int) -> None:
        """Make `iid` host `version` from `source` (TRAINER or a peer); answers WeightsLoaded.
        Full weights replace the old ones; an adapter version (a LoRA run on engines with
        engine.max_versions > 1) goes into a free slot and the engine drops the adapters no
        request there still uses (EngineWorker.load_weights)."""
        if source == TRAINER or self.restoring(source):
            # the trainer may serve it no more (then a peer that hosts it); a replacement
            # still taking its versions back holds none of them yet
            source = self.holder(version, avoid=iid)
        ref = self._carry(iid, version, source)
        self.calls.submit(LoadCall(iid, version, source, **self._sent(ref)))

    def holder(self, version: int, avoid: int, live: bool = False) -> int:
        """Who can serve `version` to instance `avoid`: the trainer while it still serves it,
        else a peer that hosts it (with `live`, one that answers). A new trainer restored
        past a version (trainer recovery) never makes it again, and over the collective
        transport a dead trainer's copies died with it."""
        if self.weights.has(version):
            return TRAINER
        if not self.capabilities.serves_weights:
            raise RuntimeError(
                f"no copy of version {version} to load on instance {avoid}: the trainer no "
                "longer holds it and these engines serve no weights"
            )
        peers = [p for p in self.driver.controller.hosts(version) if p != avoid]
        for peer in peers:
            if not self.restoring(peer) and (not live or self.alive(peer)):
                return peer
        for peer in peers:  # only replacements hold it: the first once it has it back
            if self._restored(peer) and (not live or self.alive(peer)):
                return peer
        raise RuntimeError(f"no live copy of version {version} to load on instance {avoid}")

    def restore(self, iid: int, version: int, source: int) -> None:
        """A replacement actor takes its instance's version back, before anything else
        reaches it; its answer only tells a failure (recovery's `on_restore_failed`)."""
        ref = self._carry(iid, version, source)
        self._restoring.setdefault(iid, []).append(ref)
        self.calls.submit(RestoreCall(iid, version, source, **self._sent(ref)))

    def restoring(self, iid: int, wait_s: float = 0.0) -> bool:
        """Whether `iid` is a replacement not yet holding its versions again (after waiting
        up to `wait_s` for its loads): loads still running, or one that failed (the
        replacement is then replaced in turn)."""
        refs = self._restoring.get(iid)
        if refs and _all_loaded(refs, timeout_s=wait_s):
            del self._restoring[iid]
        return iid in self._restoring

    def _restored(self, iid: int) -> bool:
        """Wait, bounded by the weight transport's timeout, for `iid`'s restoring loads."""
        return not self.restoring(iid, wait_s=self.weights.spec.timeout_s)

    def on_restored(self, report: WeightsReport, call: RestoreCall) -> None:
        """A replacement holds a version of its instance again: nothing to tell."""

    def reimport(self, call: MigrateCall) -> None:
        """Land a migration's snapshots (they outlive their source) on the current actor of
        its destination; the call keeps its source's incarnation and start time. A parcel's
        KV the source still holds is taken from it; gone with it, the requests re-prefill."""
        dst = self.workers[call.dst]
        if call.parcel:  # the KV the source holds comes as a Ray object: the new actor is outside
            ref = dst.import_parcel.remote(call.snapshots, self.workers[call.src], -1, "store")
        else:
            ref = dst.import_.remote(call.snapshots)
        generations = list(call.generations)
        generations[call.dst] = self.generations[call.dst]
        self.calls.submit(dataclasses.replace(call, ref=ref, generations=tuple(generations)))

    def replace(self, iid: int, actor: Any) -> None:
        """A new actor for instance `iid`: a new incarnation, nothing queued on it yet."""
        self.workers[iid] = actor
        self.generations[iid] += 1
        self._running.pop(iid, None)
        self._restoring.pop(iid, None)
        self._kv_above[iid] = False

    def alive(self, iid: int) -> bool:
        """Whether instance `iid`'s actor lives (one busy with a long call does)."""
        return lives(self.workers[iid].stats.remote())

    def stale(self, call: EngineCall) -> bool:
        """Whether the actor `call`'s result landed on has been replaced since."""
        return call.generations[call.lands_on] != self.generations[call.lands_on]

    def keep_running(self, iid: int) -> None:
        """Keep one stepping call queued on every instance that holds requests."""
        if self._runnable(iid) > 0 and iid not in self._running:
            ref = self.workers[iid].run.remote(self.steps_per_call)
            self._running[iid] = ref
            self.calls.submit(RunCall(iid, **self._sent(ref)))

    def running_call(self, iid: int) -> ray.ObjectRef | None:
        """The stepping call queued on `iid`, if any."""
        return self._running.get(iid)

    def run_ended(self, call: RunCall) -> None:
        """`call` is answered: queue the next one if the instance still holds work."""
        if self._running.get(call.iid) == call.ref:
            del self._running[call.iid]
        self.keep_running(call.iid)

    # ---- answers -------------------------------------------------------------------------
    def on_run(self, report: RunReport, call: RunCall) -> None:
        iid = report.instance_id
        if self._running.get(iid) == call.ref:
            del self._running[iid]
        if report.pace is not None:
            self.pace.add("engine", report.pace)
        finished = []
        for output in report.finished:
            if not self.driver.requests.live(output.request_id):
                log.warning("instance %d finished %s twice: ignored", iid, output.request_id)
                continue
            if output.waits_env:
                self._turn_ended(output)
                continue
            finished.append((self.driver.requests.spec(output.request_id), output))
        samples = self.plan.samples(finished)
        for _, output in finished:
            self.recorder.reprefill(output.reprefill_tokens)
        for at, sample in self.plan.finished(iid, samples):
            self.driver.sample_done(at, sample)
        self.recorder.mixed_steps(report.mixed_steps)
        self.recorder.prefill(
            iid, report.prefill_tokens, report.saved_tokens, report.stats.kv_blocks_cached
        )
        self._report_kv(iid, report)
        self.keep_running(iid)

    def _report_kv(self, iid: int, report: RunReport) -> None:
        usage = report.stats.kv_usage
        above = usage >= self.driver.config.orchestrator.kv_offload_threshold
        if above != self._kv_above[iid]:
            self._kv_above[iid] = above
            stats = report.stats
            self.driver.deliver(InstanceStats(iid, stats.running, stats.waiting, usage, self.now()))

    def on_sent(self, result: Any, call: SendCall) -> None:
        """A call read only for its failure ran: nothing to act on."""

    def on_loaded(self, report: WeightsReport, call: LoadCall) -> None:
        self.recorder.overhead("load_balance", self.now() - call.started)
        self.driver.deliver(WeightsLoaded(report.instance_id, report.version, self.now()))

    def on_migrated(self, landed: list[str], call: MigrateCall, source_lost: bool = False) -> None:
        """The migration's requests `landed` on its destination. When its source was
        replaced since (or its snapshots are lost), the requests it kept start again on
        the destination: their reports, if any, went with the dead actor."""
        src, dst, rids = call.src, call.dst, call.request_ids
        # Episodes whose reset is out were never on the source: they move in the books only.
        landed = [
            *landed,
            *(r for r in rids if r in self._resetting and self.driver.requests.live(r)),
        ]
        if source_lost or call.generations[src] != self.generations[src]:
            kept = [r for r in rids if self.driver.requests.live(r) and r not in set(landed)]
            self.start(dst, [self.driver.requests.spec(r) for r in kept])
            landed = [*landed, *kept]
        self.recorder.overhead("request_transfer", self.now() - call.started)
        self.driver.migration_done(src, dst, rids, landed)
        self._release_held_back(landed)
        self.keep_running(dst)

    def poll_rewards(self) -> None:
        """Hand the driver the samples the reward model scored, each on the instance the
        driver places its request now (a replaced instance's request moved)."""
        for iid, sample in self.plan.rescored():
            rid = request_id(sample.group_id, sample.sample_index)
            at = self.driver.requests.instance_of(rid) if self.driver.requests.live(rid) else None
            self.driver.sample_done(iid if at is None else at, sample)

    # ---- multi-turn episodes ---------------------------------------------------------------
    def _turn_ended(self, output) -> None:
        assert self.plan.episodes is not None, "a turn ended on a single-turn task"
        self._env_waiting.add(output.request_id)
        self.plan.episodes.turn_ended(output.request_id, output)
        spec = self.driver.requests.spec(output.request_id)
        self.driver.deliver(EnvWaiting(spec.group_id, spec.sample_index, self.now()))

    @property
    def envs_pending(self) -> int:
        return 0 if self.plan.episodes is None else self.plan.episodes.pending

    def poll_envs(self) -> None:
        """Act on the environments' answers that are in: start, continue or end each
        episode; then tell the controller of resets still out."""
        if self.plan.episodes is None:
            return
        episodes = self.plan.episodes
        for rid, ids in [*episodes.ready(), *episodes.overdue()]:
            if not self.driver.requests.live(rid):
                continue
            if rid in self._resetting:  # the first prompt (a failed reset's: the task's)
                self._held_back[rid] = (ids, None)
            elif rid not in self._env_waiting:
                continue
            elif (
                ids is not None and _tokens(episodes.last_output(rid), ids) + 1 > self.max_model_len
            ):
                self._held_back[rid] = (None, "no_room")
            else:
                self._held_back[rid] = (ids, None)
            self._release_held_back([rid])
        self._announce_resets()

    def _announce_resets(self) -> None:
        """Resets still out that the controller was not told of yet: now it is (not during
        the Dispatch itself, whose command batch an event in its midst would reorder)."""
        requests = self.driver.requests
        for rid in list(self._resetting):  # telling it may dispatch (and reset) more
            if rid not in self._env_waiting and requests.live(rid):
                self._env_waiting.add(rid)
                spec = requests.spec(rid)
                self.driver.deliver(EnvWaiting(spec.group_id, spec.sample_index, self.now()))

    def _release_held_back(self, request_ids) -> None:
        """Carry out the env's answers for requests that sit still on an instance now; one
        that is moving or interrupted gets its answer where it lands or resumes."""
        requests = self.driver.requests
        for rid in request_ids:
            if rid not in self._held_back or not requests.live(rid):
                continue
            iid = requests.instance_of(rid)
            if iid is None or requests.is_moving(rid):
                continue
            ids, reason = self._held_back.pop(rid)
            if rid in self._resetting:
                spec = requests.spec(rid)
                new = self.plan.request(spec, ids, self._resetting.pop(rid))
                self._send(iid, "adding an episode", self.workers[iid].add.remote([new]))
            elif ids is None:
                self._env_waiting.discard(rid)
                self._end_episode(rid, iid, reason)
                continue
            else:
                ref = self.workers[iid].continue_.remote(rid, ids, isinstance(ids, NewSegment))
                self._send(iid, "continuing an episode", ref)
            if rid in self._env_waiting:
                self._env_waiting.discard(rid)
                spec = requests.spec(rid)
                self.driver.deliver(EnvAnswered(spec.group_id, spec.sample_index, self.now()))
            self.keep_running(iid)

    def _end_episode(self, rid: str, iid: int, reason: str | None) -> None:
        assert self.plan.episodes is not None
        state, last = self.plan.episodes.finish(rid, reason)
        self._send(iid, "ending an episode", self.workers[iid].end.remote([rid]))
        sample = self.plan.sample(self.driver.requests.spec(rid), last, episode=state)
        self.driver.sample_done(iid, sample)

    def _runnable(self, iid: int) -> int:
        """Requests on `iid` a stepping call can advance (not waiting for their env)."""
        held = self.driver.requests.held(iid)
        if not self._env_waiting and not self._resetting:
            return held
        requests = self.driver.requests
        off_engine = self._env_waiting | self._resetting.keys()
        return held - sum(1 for r in off_engine if requests.instance_of(r) == iid)

    # ---- helpers -------------------------------------------------------------------------
    def _carry(self, iid: int, version: int, source: int) -> ray.ObjectRef:
        """Load `version` on `iid` from `source`, first telling it the older versions the
        controller holds there (their adapters stay through the load: a request of one may
        still come, its episode's reset out)."""
        worker = self.workers[iid]
        held = [v for v in self.driver.controller.instance(iid).held if v != version]
        self._send(iid, "holding versions", worker.hold_versions.remote(held))
        peer = None if source == TRAINER else self.workers[source]
        return self.weights.load(worker, version, peer)

    def _send(self, iid: int, what: str, ref: ray.ObjectRef) -> None:
        """Track a call read only for its failure (the runtime's loop stops the run on one)."""
        self.calls.submit(SendCall(iid, what, **self._sent(ref)))

    def _sent(self, ref: ray.ObjectRef) -> dict[str, Any]:
        """What every engine call records: its answer, now, each instance's incarnation."""
        return {"ref": ref, "started": self.now(), "generations": tuple(self.generations)}


def _all_loaded(refs: list[ray.ObjectRef], timeout_s: float) -> bool:
    """Whether every load of `refs` ended, within `timeout_s`, and none failed."""
    done, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if pending:
        return False
    try:
        ray.get(done, timeout=ANSWER_WAIT_S)  # ended: their answers (or errors) are there
    except ray.exceptions.RayError:
        return False
    return True


def _tokens(output, ids: list[int]) -> int:
    """The request's context once `ids` land: a new segment's prompt alone."""
    return len(ids) + (0 if isinstance(ids, NewSegment) else output.context_tokens)
