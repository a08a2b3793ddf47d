"""Simulation runtime: executes the controller's commands on cost-model instances and trainer.

A virtual clock drives the very same `Controller` the Ray runtime drives, and the shared
`Recorder` writes the same files. The simulator is also a strict executor: a command a
real runtime could not honour (dispatch to a busy or wrong-version instance, a weight load
on an instance that still holds requests or serves a peer, training on an incomplete
group) raises `ProtocolError`; a run whose queue holds nothing but timers raises
`Deadlock`. Deterministic for a seed. Token ids are placeholders (the cost model has no
vocabulary): samples carry O(1) sequences of the right length and per-token versions.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain, repeat
from pathlib import Path
from typing import Any

from dorarl.config import ConfigError
from dorarl.controller import (
    TRAINER,
    Command,
    Controller,
    ControllerConfig,
    Dispatch,
    Event,
    Finish,
    InstanceStats,
    Interrupt,
    LoadWeights,
    Migrate,
    MigrationDone,
    Offload,
    ProtocolError,
    Resume,
    SampleDone,
    SetTimer,
    Start,
    Timer,
    Train,
    TrainDone,
    WeightsLoaded,
    request_id,
)
from dorarl.data import Group, Sample
from dorarl.data.lengths import LengthDist
from dorarl.record.recorder import Recorder
from dorarl.sim.clock import EventQueue
from dorarl.sim.cost import CostModel
from dorarl.sim.instance import SimInstance, SimRequest

log = logging.getLogger(__name__)

Observer = Callable[[Controller, Event, list[Command]], None]


class Deadlock(RuntimeError):
    """Nothing left to happen but timers, and the run is not finished."""


@dataclass
class RunResult:
    summary: dict[str, Any]
    steps: list[dict[str, Any]]
    out_dir: Path | None
    controller: Controller
    events: int


@dataclass(frozen=True, slots=True)
class _Wake:
    instance_id: int
    epoch: int


@dataclass(frozen=True, slots=True)
class _Arrival:
    request_ids: tuple[str, ...]
    src: int
    dst: int


class SimRuntime:
    def __init__(
        self,
        config: ControllerConfig,
        cost: CostModel | None = None,
        lengths: LengthDist | None = None,
        seed: int = 0,
        out_dir: str | Path | None = None,
        *,
        observer: Observer | None = None,
        trace: bool = True,
        trajectories: bool = True,
        watchdog_events: int = 5_000_000,
    ) -> None:
        self.config, self.cost = config, cost or CostModel()
        self.lengths, self.seed = lengths or LengthDist(), seed
        _validate(config, self.cost, self.lengths)
        self.controller = Controller(config)
        self.observer = observer
        self.recorder = Recorder(
            out_dir,
            mode=config.mode,
            k=config.effective_K,
            num_instances=config.instances,
            slots_per_instance=config.slots,
            trajectories=trajectories,
            trace=trace,
            first_version=config.initial_version,
        )
        threshold = config.orchestrator.kv_offload_threshold
        self.instances = [
            SimInstance(i, self.cost, config.slots, threshold) for i in range(config.instances)
        ]
        for inst in self.instances:
            inst.version = config.initial_version
        self.queue = EventQueue()
        self.now = 0.0
        self.finished = False
        self.events = 0
        self._pending = 0  # queued items other than timers
        self._watchdog = watchdog_events  # events allowed without a finished training step
        self._since_step = 0
        self._published = config.initial_version
        self._links: dict[int, float] = {}  # weight source -> busy until
        self._groups: dict[int, tuple[int, int]] = {}  # group -> (prompt index, version)
        self._lengths: dict[int, list[int]] = {}
        self._completed: dict[int, list[SimRequest]] = defaultdict(list)
        self._parked: dict[str, SimRequest] = {}
        self._transit: dict[str, SimRequest] = {}
        self._execute_table = self._executors()

    # ---- main loop -----------------------------------------------------------------------
    def run(self) -> RunResult:
        self._deliver(Start(0.0))
        while not self.finished:
            if not self._pending:
                raise Deadlock(f"only timers left at t={self.now:.3f}s: {self.controller.counts()}")
            at, item = self.queue.pop()
            if not isinstance(item, Timer):
                self._pending -= 1
            self.now = at
            self._on_item(item)
        self._report_lost()
        summary = self.recorder.close(self.now)
        return RunResult(
            summary, self.recorder.steps, self.recorder.out_dir, self.controller, self.events
        )

    def _push(self, at: float, item: Any) -> None:
        if not isinstance(item, Timer):
            self._pending += 1
        self.queue.push(at, item)

    def _on_item(self, item: Any) -> None:
        if isinstance(item, _Wake):
            self._on_wake(item)
        elif isinstance(item, _Arrival):
            self._on_arrival(item)
        else:
            if isinstance(item, WeightsLoaded):
                inst = self.instances[item.instance_id]
                inst.version, inst.ready = item.version, True
            elif isinstance(item, TrainDone):
                self._published = item.new_version
            self._deliver(item)

    def _deliver(self, event: Event) -> None:
        commands = self.controller.handle(event)
        self.events += 1
        self._since_step = 0 if isinstance(event, TrainDone) else self._since_step + 1
        if self._since_step > self._watchdog:
            raise Deadlock(
                f"{self._since_step} events without a training step (livelock?) at t={self.now:.3f}s"
            )
        self.recorder.observe(event, commands)
        if self.observer is not None:
            self.observer(self.controller, event, commands)
        for command in commands:
            self._execute_table[type(command)](command)

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
            self._complete(inst, req)
        self._kv_housekeeping(inst)
        self._touch(inst)

    def _complete(self, inst: SimInstance, req: SimRequest) -> None:
        self._completed[req.group_id].append(req)
        tokens = req.target_len
        self._deliver(
            SampleDone(req.group_id, req.sample_index, inst.instance_id, tokens, self.now)
        )

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
        if inst.kv_above and resident >= inst.kv_cap - 1e-6 * inst.kv_cap and len(inst.active) >= 2:
            self._offload_request(inst, next(reversed(inst.active)))  # engine safety net
        while inst.offloaded and inst.can_restore():
            req = inst.offloaded.pop(next(iter(inst.offloaded)))
            inst.stall(self.now, self.cost.host_transfer_s(req.context))
            inst.join(req)

    def _on_arrival(self, arrival: _Arrival) -> None:
        dst = self.instances[arrival.dst]
        # an empty arrival (every named request had finished first) may find dst moved on
        if arrival.request_ids and not dst.ready:
            raise ProtocolError(
                f"instance {dst.instance_id} changed version while requests migrated in"
            )
        dst.advance(self.now)
        for rid in arrival.request_ids:
            dst.join(self._transit.pop(rid))
        dst.incoming -= len(arrival.request_ids)
        self._touch(dst)
        self._deliver(MigrationDone(arrival.request_ids, arrival.src, arrival.dst, self.now))

    # ---- command execution ---------------------------------------------------------------
    def _executors(self) -> dict[type, Callable[[Any], None]]:
        return {
            Dispatch: self._dispatch,
            LoadWeights: self._load,
            Migrate: self._migrate,
            Interrupt: self._interrupt,
            Resume: self._resume,
            Offload: self._offload,
            Train: self._train,
            SetTimer: lambda c: self._push(max(c.at, self.now), Timer(max(c.at, self.now))),
            Finish: self._finish,
        }

    def _dispatch(self, c: Dispatch) -> None:
        inst = self._serving(c.instance_id, c.version, len(c.sample_indices), c)
        self._groups.setdefault(c.group_id, (c.prompt_index, c.version))
        if c.group_id not in self._lengths:
            self._lengths[c.group_id] = self.lengths.group_lengths(
                self.seed, c.group_id, self.config.group_size
            )
        lengths = self._lengths[c.group_id]
        inst.advance(self.now)
        inst.stall(self.now, self.cost.prefill_per_token_s * self.lengths.prompt_len)
        for s in c.sample_indices:
            rid = request_id(c.group_id, s)
            req = SimRequest(
                rid, c.group_id, s, self.lengths.prompt_len, lengths[s], segments=[(c.version, 0)]
            )
            inst.join(req)
        self._touch(inst)

    def _load(self, c: LoadWeights) -> None:
        inst = self.instances[c.instance_id]
        if inst.holding or self._links.get(inst.instance_id, 0.0) > self.now:
            raise ProtocolError(f"{c}: instance still holds requests or serves weights")
        self._check_source(c)
        inst.ready = False
        start = max(self.now, inst.busy_until) + self.cost.free_cache_s
        begin = max(start, self._links.get(c.source, 0.0))
        end = begin + self.cost.weight_load_s(from_trainer=c.source == TRAINER)
        self._links[c.source] = end
        self.recorder.overhead("free_cache", self.cost.free_cache_s)
        self.recorder.overhead("load_balance", end - begin)
        self._push(end, WeightsLoaded(c.instance_id, c.version, end))

    def _check_source(self, c: LoadWeights) -> None:
        if c.source == TRAINER:
            if c.version != self._published:
                raise ProtocolError(f"{c}: the trainer holds v{self._published}")
            return
        peer = self.instances[c.source]
        if not peer.ready or peer.version != c.version:
            raise ProtocolError(f"{c}: peer {c.source} does not host v{c.version}")

    def _migrate(self, c: Migrate) -> None:
        src, dst = self.instances[c.src], self.instances[c.dst]
        if not dst.ready or dst.version != src.version:
            raise ProtocolError(f"{c}: destination does not host v{src.version}")
        src.advance(self.now)
        moved = [
            self._take(src, rid)
            for rid in c.request_ids
            if rid in src.active or rid in src.offloaded
        ]
        if dst.holding + len(moved) > dst.slots:
            raise ProtocolError(f"{c}: destination has no room")
        duration = self.cost.migration_s(sum(r.context for r in moved))
        for req in moved:
            req.migrations += 1
            self._transit[req.rid] = req
        src.busy_until = max(src.busy_until, self.now) + duration
        dst.incoming += len(moved)
        self.recorder.overhead("request_transfer", duration)
        self._push(self.now + duration, _Arrival(tuple(r.rid for r in moved), c.src, c.dst))
        self._touch(src)

    def _interrupt(self, c: Interrupt) -> None:
        inst = self.instances[c.instance_id]
        inst.advance(self.now)
        for rid in c.request_ids:
            if rid in inst.active or rid in inst.offloaded:
                self._parked[rid] = self._take(inst, rid)
        self._touch(inst)

    def _resume(self, c: Resume) -> None:
        inst = self._serving(c.instance_id, c.version, len(c.request_ids), c)
        inst.advance(self.now)
        for rid in c.request_ids:
            req = self._parked.pop(rid)
            tokens = int(round(req.context))
            if req.segments[-1][0] != c.version:
                req.segments.append((c.version, int(round(req.gen))))
            inst.stall(self.now, self.cost.prefill_per_token_s * tokens)
            self.recorder.reprefill(tokens)
            inst.join(req)
        self._touch(inst)

    def _offload(self, c: Offload) -> None:
        inst = self.instances[c.instance_id]
        inst.advance(self.now)
        if c.request_id in inst.active and len(inst.active) >= 2:
            self._offload_request(inst, c.request_id)
        self._touch(inst)

    def _offload_request(self, inst: SimInstance, rid: str) -> None:
        req = inst.leave(rid)
        req.offloads += 1
        inst.offloaded[rid] = req
        inst.stall(self.now, self.cost.host_transfer_s(req.context))

    def _train(self, c: Train) -> None:
        if self._published != c.version:
            raise ProtocolError(f"{c}: the trainer is at v{self._published}")
        groups = [self._group(gid) for gid in c.group_ids]
        self.recorder.consumed(groups, c.version)
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for g in groups for s in g.samples)
        end = self.now + self.cost.train_s(tokens)
        self._push(end, TrainDone(c.version + 1, end))

    def _finish(self, c: Finish) -> None:
        log.info("simulation finished at t=%.2fs: %s", self.now, c.reason)
        self.finished = True

    # ---- helpers -------------------------------------------------------------------------
    def _serving(self, iid: int, version: int, extra: int, c: Command) -> SimInstance:
        inst = self.instances[iid]
        if not inst.ready or inst.version != version:
            raise ProtocolError(f"{c}: instance {iid} is not serving v{version}")
        if inst.holding + extra > inst.slots:
            raise ProtocolError(f"{c}: instance {iid} would exceed {inst.slots} slots")
        return inst

    def _take(self, inst: SimInstance, rid: str) -> SimRequest:
        if rid in inst.offloaded:
            return inst.offloaded.pop(rid)
        return inst.leave(rid)

    def _group(self, gid: int) -> Group:
        reqs = self._completed.pop(gid, [])
        if len(reqs) != self.config.group_size:
            raise ProtocolError(
                f"Train: group {gid} has {len(reqs)}/{self.config.group_size} samples"
            )
        self._lengths.pop(gid, None)
        prompt_index, version = self._groups.pop(gid)
        samples = [_sample(r, prompt_index) for r in sorted(reqs, key=lambda r: r.sample_index)]
        return Group(gid, prompt_index, version, samples)

    def _report_lost(self) -> None:
        """Every request the controller believes in flight must exist somewhere here."""
        known = set(self._parked) | set(self._transit)
        for inst in self.instances:
            known.update(inst.active, inst.offloaded)
        for rid, req in self.controller.ledger.requests.items():
            if rid not in known:
                self.recorder.lost(req.group_id, "request_lost_by_runtime")


class _Repeat(Sequence[int]):
    """`n` copies of `value` in O(1) memory (placeholder token ids, one-version samples)."""

    def __init__(self, value: int, n: int) -> None:
        self.value, self.n = value, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self.value] * len(range(*i.indices(self.n)))
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return self.value

    def __iter__(self):
        return repeat(self.value, self.n)


class _Segments(Sequence[int]):
    """Per-token versions from (version, first token) segments, without a list per token."""

    def __init__(self, segments: list[tuple[int, int]], n: int) -> None:
        bounds = [start for _, start in segments[1:]] + [n]
        self.runs = [(v, end - start) for (v, start), end in zip(segments, bounds, strict=True)]
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):  # type: ignore[override]
        return list(self)[i]

    def __iter__(self):
        return chain.from_iterable(repeat(v, k) for v, k in self.runs)


def _sample(req: SimRequest, prompt_index: int) -> Sample:
    n = req.target_len
    versions: Sequence[int] = (
        _Repeat(req.segments[0][0], n) if len(req.segments) == 1 else _Segments(req.segments, n)
    )
    return Sample(
        group_id=req.group_id,
        sample_index=req.sample_index,
        prompt_id=prompt_index,
        prompt_ids=_Repeat(0, req.prompt_len),  # type: ignore[arg-type]
        response_ids=_Repeat(0, n),  # type: ignore[arg-type]
        versions=versions,  # type: ignore[arg-type]
        migrations=req.migrations,
        offloads=req.offloads,
    )


def _validate(config: ControllerConfig, cost: CostModel, lengths: LengthDist) -> None:
    config.validate()
    cost.validate()
    lengths.validate()
    longest = lengths.prompt_len + lengths.max_len
    if longest > cost.kv_capacity_tokens:
        raise ConfigError(
            f"kv_capacity_tokens: {cost.kv_capacity_tokens} cannot hold one request of {longest} tokens"
        )
