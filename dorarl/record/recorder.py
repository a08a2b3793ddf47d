"""Run recorder for every runtime: metrics.jsonl, trajectories.jsonl, summary.json, trace.json.

It reads the controller's event/command stream (`observe`) and takes from the runtime only
what the stream lacks: consumed groups, trainer metrics, measured overheads, re-prefill
work, requests the runtime lost. Times are seconds since run start, given by the runtime.
Its group and slot accounting is its own (not the controller's), so tests can check one
against the other. Every dispatched group ends consumed once, complete, or in flight;
anything else is reported under `dropped` with a reason.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dorarl.controller import commands as cmd
from dorarl.controller import events as ev
from dorarl.data import Group, Sample
from dorarl.record.trace import (
    MIGRATION_TID,
    TRAINER_PID,
    VERSION_TID,
    WEIGHTS_TID,
    TraceBuilder,
    instance_pid,
)

# Every overhead kind a runtime may report. A runtime reports only those it measures (it
# builds its Recorder with `overhead_kinds`): the Ray runtime has no free_cache step (see
# RayRuntime.OVERHEAD_KINDS), the simulator models all three.
OVERHEAD_KINDS = ("load_balance", "request_transfer", "free_cache")


@dataclass
class _Step:
    """Accumulators of the training step in progress (from the previous TrainDone)."""

    start: float
    area0: list[float]
    train_start: float | None = None
    version: int | None = None
    groups: int = 0
    tokens: int = 0
    rewards: list[float] = field(default_factory=list)
    staleness: Counter = field(default_factory=Counter)
    overhead: dict[str, float] = field(default_factory=dict)
    reprefill: int = 0
    migrations: int = 0
    offloads: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class Recorder:
    def __init__(
        self,
        out_dir: str | Path | None,
        *,
        mode: str,
        k: int,
        num_instances: int,
        slots_per_instance: int,
        trajectories: bool = True,
        trace: bool = True,
        first_version: int = 0,
        overhead_kinds: Sequence[str] = OVERHEAD_KINDS,
        texts: Callable[[Sample], dict[str, str]] | None = None,
    ) -> None:
        unknown = set(overhead_kinds) - set(OVERHEAD_KINDS)
        if unknown:
            raise ValueError(f"unknown overhead kinds {sorted(unknown)}; known: {OVERHEAD_KINDS}")
        self.overhead_kinds = tuple(overhead_kinds)  # what this run measures, nothing else
        self.mode, self.k = mode, k
        self.first_version = first_version  # a resumed run: steps and versions continue
        self.texts = texts  # sample -> text fields of its trajectory row (record.text)
        self.num_instances, self.slots = num_instances, slots_per_instance
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self._metrics_file = self._traj_file = None
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            how = "a" if first_version else "w"  # a resumed run adds to the run's files
            self._metrics_file = open(self.out_dir / "metrics.jsonl", how)  # noqa: SIM115
            if trajectories:
                self._traj_file = open(self.out_dir / "trajectories.jsonl", how)  # noqa: SIM115
        self.trace = TraceBuilder(num_instances) if trace and self.out_dir is not None else None
        self.steps: list[dict[str, Any]] = []
        self.summary: dict[str, Any] | None = None
        self._init_instances(num_instances)
        self._where: dict[str, int] = {}
        self._parked: dict[str, int] = {}
        self._remaining: dict[int, int] = {}
        self._state: dict[int, str] = {}
        self._migrating: dict[tuple[int, int], deque[tuple[float, int]]] = defaultdict(deque)
        self.counts: Counter = Counter()
        self.dropped: Counter = Counter()
        self._totals: Counter = Counter()
        self._step = self._new_step(0.0, [0.0] * num_instances)
        self._events = self._event_handlers()
        self._commands = self._command_handlers()

    def _init_instances(self, n: int) -> None:
        self._busy = [0] * n
        self._area = [0.0] * n
        self._area_at = [0.0] * n
        self._hosted = [self.first_version] * n
        self._assigned = [self.first_version] * n
        self._hosted_since = [0.0] * n
        self._loading: dict[int, tuple[float, int, int]] = {}

    # ---- inputs --------------------------------------------------------------------------
    def observe(self, event: ev.Event, commands: Sequence[cmd.Command]) -> None:
        """Record one controller step: the event it handled and the commands it returned."""
        handler = self._events.get(type(event))
        if handler is not None:
            handler(event)
        for command in commands:
            self._commands[type(command)](command, event.now)

    def consumed(self, groups: Iterable[Group], version: int) -> None:
        """The runtime hands the groups of the `Train` it is executing (rewards filled in)."""
        for group in groups:
            self._consume_group(group, version)

    def step_metrics(self, metrics: Mapping[str, Any]) -> None:
        """Extra metrics of the step in progress (trainer metrics, `eval_accuracy`, ...)."""
        self._step.extra.update(metrics)

    def overhead(self, kind: str, seconds: float) -> None:
        """Instance-seconds spent on `kind` (one of this run's overhead kinds) during this step."""
        if kind not in OVERHEAD_KINDS:
            raise ValueError(f"unknown overhead kind {kind!r}; expected one of {OVERHEAD_KINDS}")
        if kind not in self.overhead_kinds:
            raise ValueError(
                f"overhead kind {kind!r} is not measured by this run ({self.overhead_kinds})"
            )
        self._step.overhead[kind] += seconds

    def reprefill(self, tokens: int) -> None:
        self._step.reprefill += tokens

    def restarted(self, instance_id: int, requests: int, now: float) -> None:
        """A dead instance was replaced; its `requests` start again from their prompts."""
        self.counts["engine_restarts"] += 1
        self.counts["restarted_requests"] += requests
        if self.trace is not None:
            name = f"instance restarted ({requests} requests start again)"
            self.trace.instant(instance_pid(instance_id), name, now)

    def trainer_restarted(self, from_version: int, replayed_steps: int, now: float) -> None:
        """A dead trainer was replaced from `from_version`; `replayed_steps` are made again."""
        self.counts["trainer_restarts"] += 1
        self.counts["replayed_steps"] += replayed_steps
        if self.trace is not None:
            name = f"trainer restarted from v{from_version} ({replayed_steps} steps replayed)"
            self.trace.instant(TRAINER_PID, name, now)

    def replay_mismatch(self) -> None:
        """A replayed training step did not reproduce the original's loss exactly."""
        self.counts["replay_mismatches"] += 1

    def lost(self, group_id: int, reason: str) -> None:
        """A runtime could not keep a group (e.g. an engine failed): reported as dropped."""
        if self._state.get(group_id) != "dropped":
            self._state[group_id] = "dropped"
            self.dropped[reason] += 1

    # ---- event handlers ------------------------------------------------------------------
    def _event_handlers(self) -> dict[type, Any]:
        return {
            ev.SampleDone: self._on_sample_done,
            ev.WeightsLoaded: self._on_loaded,
            ev.MigrationDone: self._on_migrated,
            ev.TrainDone: self._on_train_done,
        }

    def _on_sample_done(self, e: ev.SampleDone) -> None:
        rid = cmd.request_id(e.group_id, e.sample_index)
        inst = self._where.pop(rid, None)
        if inst is not None:
            self._set_busy(inst, -1, e.now)
        else:
            self._parked.pop(rid, None)
        if e.group_id not in self._remaining:
            self.dropped["sample_of_unknown_group"] += 1
            return
        self._remaining[e.group_id] -= 1
        if self._remaining[e.group_id] == 0:
            del self._remaining[e.group_id]
            if self._state[e.group_id] == "running":
                self._state[e.group_id] = "complete"
                self.counts["completed"] += 1

    def _on_loaded(self, e: ev.WeightsLoaded) -> None:
        start, version, source = self._loading.pop(e.instance_id, (e.now, e.version, cmd.TRAINER))
        if self.trace is not None:
            name = f"load v{version} from " + (
                "trainer" if source == cmd.TRAINER else f"instance {source}"
            )
            self.trace.slice(instance_pid(e.instance_id), WEIGHTS_TID, name, start, e.now)
        self._hosted[e.instance_id] = e.version
        self._hosted_since[e.instance_id] = e.now

    def _on_migrated(self, e: ev.MigrationDone) -> None:
        pending = self._migrating[(e.src, e.dst)]
        start, count = pending.popleft() if pending else (e.now, len(e.request_ids))
        if self.trace is not None:
            name = f"migrate {count} -> instance {e.dst}"
            self.trace.slice(instance_pid(e.src), MIGRATION_TID, name, start, e.now)

    def _on_train_done(self, e: ev.TrainDone) -> None:
        line = self._step_line(e.now, e.new_version)
        self.steps.append(line)
        if self._metrics_file is not None:
            self._metrics_file.write(json.dumps(line) + "\n")
            self._metrics_file.flush()
        if self.trace is not None:
            step = self._step
            name = f"train step {line['step']} (v{step.version} -> v{e.new_version})"
            start = e.now if step.train_start is None else step.train_start
            self.trace.slice(TRAINER_PID, 0, name, start, e.now, groups=step.groups)
        self._totals.update(
            step_time_s=line["step_time_s"],
            rollout_only_s=line["rollout_only_s"],
            tokens=line["consumed_tokens"],
        )
        self._step = self._new_step(e.now, list(self._area))

    def _new_step(self, start: float, area0: list[float]) -> _Step:
        return _Step(start, area0, overhead=dict.fromkeys(self.overhead_kinds, 0.0))

    # ---- command handlers ----------------------------------------------------------------
    def _command_handlers(self) -> dict[type, Any]:
        return {
            cmd.Dispatch: self._on_dispatch,
            cmd.LoadWeights: self._on_load,
            cmd.Migrate: self._on_migrate,
            cmd.Interrupt: self._on_interrupt,
            cmd.Resume: self._on_resume,
            cmd.Offload: self._on_offload,
            cmd.Train: self._on_train,
            cmd.SetTimer: lambda c, now: None,
            cmd.Finish: lambda c, now: None,
        }

    def _on_dispatch(self, c: cmd.Dispatch, now: float) -> None:
        if c.group_id not in self._state:
            self._state[c.group_id] = "running"
            self._remaining[c.group_id] = 0
            self.counts["dispatched"] += 1
        self._remaining[c.group_id] += len(c.sample_indices)
        for s in c.sample_indices:
            self._where[cmd.request_id(c.group_id, s)] = c.instance_id
        self._set_busy(c.instance_id, len(c.sample_indices), now)

    def _on_load(self, c: cmd.LoadWeights, now: float) -> None:
        i = c.instance_id
        if self.trace is not None:
            self.trace.slice(
                instance_pid(i), VERSION_TID, f"v{self._hosted[i]}", self._hosted_since[i], now
            )
        self._loading[i] = (now, c.version, c.source)
        self._assigned[i] = c.version

    def _on_migrate(self, c: cmd.Migrate, now: float) -> None:
        moved = [r for r in c.request_ids if self._where.get(r) == c.src]
        for rid in moved:
            self._where[rid] = c.dst
        self._set_busy(c.src, -len(moved), now)
        self._set_busy(c.dst, len(moved), now)
        self._step.migrations += len(moved)
        self._migrating[(c.src, c.dst)].append((now, len(moved)))

    def _on_interrupt(self, c: cmd.Interrupt, now: float) -> None:
        stopped = [r for r in c.request_ids if self._where.get(r) == c.instance_id]
        for rid in stopped:
            del self._where[rid]
            self._parked[rid] = c.instance_id
        self._set_busy(c.instance_id, -len(stopped), now)

    def _on_resume(self, c: cmd.Resume, now: float) -> None:
        resumed = [r for r in c.request_ids if self._parked.pop(r, None) is not None]
        for rid in resumed:
            self._where[rid] = c.instance_id
        self._set_busy(c.instance_id, len(resumed), now)

    def _on_offload(self, c: cmd.Offload, now: float) -> None:
        self._step.offloads += 1

    def _on_train(self, c: cmd.Train, now: float) -> None:
        self._step.train_start = now
        self._step.version = c.version
        if self.trace is not None and now > self._step.start:
            self.trace.slice(TRAINER_PID, 0, "waiting for rollout", self._step.start, now)

    # ---- bookkeeping ---------------------------------------------------------------------
    def _set_busy(self, inst: int, delta: int, now: float) -> None:
        if not delta:
            return
        self._settle(inst, now)
        self._busy[inst] += delta
        if self.trace is not None:
            self.trace.counter(instance_pid(inst), "busy_slots", now, self._busy[inst])

    def _settle(self, inst: int, now: float) -> None:
        self._area[inst] += self._busy[inst] * (now - self._area_at[inst])
        self._area_at[inst] = now

    def _consume_group(self, group: Group, version: int) -> None:
        state = self._state.get(group.group_id)
        if state != "complete":
            self.dropped[f"consumed_while_{state or 'unknown'}"] += 1
        self._state[group.group_id] = "consumed"
        self.counts["consumed"] += 1
        step = self._step
        step.groups += 1
        # per-token versions never decrease along a trajectory (a resume only moves forward),
        # so the oldest is the first: O(1) even for long responses
        behavior = min(
            (s.versions[0] for s in group.samples if len(s.versions)), default=group.version
        )
        step.staleness[version - behavior] += 1
        for sample in group.samples:
            step.tokens += len(sample.response_ids)
            step.rewards.append(sample.reward)
            if self._traj_file is not None:
                self._traj_file.write(json.dumps(self._trajectory(sample, group, version)) + "\n")

    def _trajectory(self, sample: Sample, group: Group, version: int) -> dict[str, Any]:
        versions = sample.versions
        if self.mode == "partial_rollout" or (len(versions) and versions[0] != versions[-1]):
            behavior: int | list[int] = list(versions)
        else:
            behavior = versions[0] if len(versions) else group.version
        return {
            "group_id": group.group_id,
            "sample_index": sample.sample_index,
            "prompt_id": sample.prompt_id,
            "behavior_version": behavior,
            "train_version": version,
            "response_tokens": len(sample.response_ids),
            "reward": sample.reward,
            "migrations": sample.migrations,
            "offloads": sample.offloads,
        } | (self.texts(sample) if self.texts is not None else {})

    def _step_line(self, now: float, new_version: int) -> dict[str, Any]:
        step = self._step
        for i in range(self.num_instances):
            self._settle(i, now)
        duration = now - step.start
        capacity = self.slots * duration
        util = [
            (a - a0) / capacity if capacity > 0 else 0.0
            for a, a0 in zip(self._area, step.area0, strict=True)
        ]
        train_start = step.train_start if step.train_start is not None else now
        line: dict[str, Any] = {
            "step": self.first_version + len(self.steps),
            "version": step.version,
            "new_version": new_version,
            "time_s": now,
            "step_time_s": duration,
            "rollout_only_s": train_start - step.start,
            "train_time_s": now - train_start,
            "consumed_groups": step.groups,
            "consumed_tokens": step.tokens,
            "tokens_per_s": step.tokens / duration if duration > 0 else 0.0,
            "reward_mean": sum(step.rewards) / len(step.rewards) if step.rewards else 0.0,
            "staleness": {str(s): n for s, n in sorted(step.staleness.items())},
            "instances_per_version": {
                str(v): n for v, n in sorted(Counter(self._assigned).items())
            },
            "overhead_s": dict(step.overhead),
            "overhead_share": {
                k: _share(v, duration * self.num_instances) for k, v in step.overhead.items()
            },
            "slot_utilization": sum(util) / len(util),
            "slot_utilization_per_instance": util,
            "reprefill_tokens": step.reprefill,
            "migrations": step.migrations,
            "offloads": step.offloads,
        }
        self._totals.update({f"overhead_{k}": v for k, v in step.overhead.items()})
        self._totals.update(
            reprefill=step.reprefill, migrations=step.migrations, offloads=step.offloads
        )
        return line | step.extra

    # ---- end of run ----------------------------------------------------------------------
    def close(self, now: float) -> dict[str, Any]:
        """Write summary.json (and trace.json); returns the summary."""
        states = Counter(self._state.values())
        totals, wall = self._totals, now
        for i in range(self.num_instances):
            self._settle(i, now)
            if self.trace is not None and i not in self._loading:
                self.trace.slice(
                    instance_pid(i), VERSION_TID, f"v{self._hosted[i]}", self._hosted_since[i], now
                )
        summary: dict[str, Any] = {
            "mode": self.mode,
            "K": self.k,
            "steps": len(self.steps),
            "dispatched": self.counts["dispatched"],
            "completed": self.counts["completed"],
            "consumed": self.counts["consumed"],
            "in_flight_at_end": states["running"],
            "queued_at_end": states["complete"],
            "dropped": dict(self.dropped),
            "dropped_total": sum(self.dropped.values()),
            "wall_time_s": wall,
            "consumed_tokens": totals["tokens"],
            "throughput_tokens_per_s": _share(totals["tokens"], wall),
            "mean_step_time_s": _share(totals["step_time_s"], len(self.steps)),
            "rollout_only_share": _share(totals["rollout_only_s"], totals["step_time_s"]),
            "slot_utilization": _share(sum(self._area), wall * self.slots * self.num_instances),
            "overhead_share": {
                k: _share(totals[f"overhead_{k}"], wall * self.num_instances)
                for k in self.overhead_kinds
            },
            "migrations": totals["migrations"],
            "offloads": totals["offloads"],
            "reprefill_tokens": totals["reprefill"],
            "engine_restarts": self.counts["engine_restarts"],
            "restarted_requests": self.counts["restarted_requests"],
            "trainer_restarts": self.counts["trainer_restarts"],
            "replayed_steps": self.counts["replayed_steps"],
            "replay_mismatches": self.counts["replay_mismatches"],
        }
        self.summary = summary
        self._write_outputs(summary)
        return summary

    def _write_outputs(self, summary: dict[str, Any]) -> None:
        for f in (self._metrics_file, self._traj_file):
            if f is not None:
                f.close()
        if self.out_dir is None:
            return
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if self.trace is not None:
            self.trace.write(self.out_dir / "trace.json")


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0
