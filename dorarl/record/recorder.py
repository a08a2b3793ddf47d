"""Run recorder for every runtime: metrics.jsonl, trajectories.jsonl, summary.json, trace.json.

It reads the controller's event/command stream (`observe`) and takes from the runtime only
what the stream lacks: consumed groups, trainer metrics, measured overheads, re-prefill
work, requests the runtime lost. Times are seconds since run start, given by the runtime.
Its group and slot accounting is its own (not the controller's), so tests can check one
against the other. Every dispatched group ends consumed once, filtered once (dynamic
sampling: its rewards were all equal), complete, or in flight; anything else is reported
under `dropped` with a reason. The pieces: `GroupAccount`
(groups.py), `SlotUsage` (slots.py), `VersionLanes` (versions.py), `RunFiles` (files.py)
and the trace (trace.py); this module turns them into step rows and the summary.
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dorarl.controller import commands as cmd
from dorarl.controller import events as ev
from dorarl.data import Group, Sample
from dorarl.engine.outputs import prefix_hit_rate
from dorarl.record.files import RunFiles
from dorarl.record.groups import GroupAccount
from dorarl.record.slots import SlotUsage
from dorarl.record.trace import (
    MIGRATION_TID,
    REWARD_MODEL_PID,
    TRAINER_PID,
    TraceBuilder,
    instance_pid,
)
from dorarl.record.versions import VersionLanes
from dorarl.run_layout import RunFolder

# Every overhead kind a runtime may report. A runtime reports only those it measures (it
# builds its Recorder with `overhead_kinds`): the Ray runtime has no free_cache step (see
# RayRuntime.OVERHEAD_KINDS), the simulator models all three.
OVERHEAD_KINDS = ("load_balance", "request_transfer", "free_cache")


@dataclass(frozen=True)
class RunInfo:
    """What the recorded run is: its mode and bound, its instances and slots, the
    version it starts at (a resumed run continues its steps), the overheads it measures."""

    mode: str
    k: int
    num_instances: int
    slots: int
    first_version: int
    overhead_kinds: tuple[str, ...]


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
    reward_parts: dict[str, list[float]] = field(default_factory=dict)  # a user's, by name
    staleness: Counter = field(default_factory=Counter)
    overhead: dict[str, float] = field(default_factory=dict)
    filtered: int = 0
    reprefill: int = 0
    prefill: int = 0  # prompt tokens the engines computed
    prefill_saved: int = 0  # prompt tokens whose KV their prefix caches gave
    migrations: int = 0
    offloads: int = 0
    mixed_steps: int = 0  # engine steps that ran requests of two or more versions
    reward_model_s: float = 0.0  # the reward model's seconds on its batches
    reward_model_batches: int = 0
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
        versions_per_instance: int = 1,
        overhead_kinds: Sequence[str] = OVERHEAD_KINDS,
        texts: Callable[[Sample], dict[str, str]] | None = None,
        records_dir: str | Path | None = None,  # summary.json and trace.json (default out_dir)
    ) -> None:
        unknown = set(overhead_kinds) - set(OVERHEAD_KINDS)
        if unknown:
            raise ValueError(f"unknown overhead kinds {sorted(unknown)}; known: {OVERHEAD_KINDS}")
        self.run = RunInfo(
            mode, k, num_instances, slots_per_instance, first_version, tuple(overhead_kinds)
        )
        self.texts = texts  # sample -> text fields of its trajectory row (record.text)
        self.files = RunFiles(
            out_dir, trajectories=trajectories, append=bool(first_version), records_dir=records_dir
        )
        self.trace = TraceBuilder(num_instances) if trace and out_dir is not None else None
        self.steps: list[dict[str, Any]] = []
        self.summary: dict[str, Any] | None = None
        self.groups = GroupAccount()
        self.usage = SlotUsage(
            num_instances, self._busy_counter if self.trace else None, slots_per_instance
        )
        self.lanes = VersionLanes(
            num_instances, first_version, self.trace, keeps_old=versions_per_instance > 1
        )
        self.faults: Counter = Counter()  # restarts, replayed steps, replay mismatches
        self.deaths: list[dict[str, Any]] = []  # each worker death: who, why, when
        self.engines: dict[int, dict[str, Any]] = {}  # each engine's set-up, where reported
        self._migrating: dict[tuple[int, int], deque[tuple[float, int]]] = defaultdict(deque)
        self._totals: Counter = Counter()
        self._cached_blocks: dict[int, int] = {}  # each instance's, as it last reported
        self._staleness: Counter = Counter()  # consumed groups by staleness, over the steps
        self._step = self._new_step(0.0, [0.0] * num_instances)
        self._events = self._event_handlers()
        self._commands = self._command_handlers()

    @property
    def overhead_kinds(self) -> tuple[str, ...]:
        """The overheads this run measures, nothing else."""
        return self.run.overhead_kinds

    @property
    def out_dir(self) -> Path | None:
        return self.files.out_dir

    @property
    def texts_path(self) -> Path | None:
        """The trajectories.jsonl that holds prompt, answer and response texts (record.text),
        or None when none does."""
        if self.texts is None or not self.files.writes_trajectories:
            return None
        return RunFolder(self.files.out_dir).trajectories

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

    def filtered(self, group: Group, step: int) -> None:
        """The runtime hands a group the controller filtered (`FilterGroup`) while `step`
        was the newest version: counted in that step's row, its samples marked in
        trajectories.jsonl, never trained."""
        self.groups.filtered(group.group_id)
        self._step.filtered += 1
        if self.files.writes_trajectories:
            for sample in group.samples:
                self.files.trajectory_row(self._filtered_trajectory(sample, group, step))

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

    def prefill(self, instance_id: int, computed: int, saved: int, cached_blocks: int) -> None:
        """Prompt tokens an instance computed and its prefix cache saved since its last
        report, and the blocks its cache holds now (the step row sums the latest of each)."""
        self._step.prefill += computed
        self._step.prefill_saved += saved
        self._cached_blocks[instance_id] = cached_blocks

    def mixed_steps(self, steps: int) -> None:
        """Engine steps whose batch ran requests of two or more versions (adapters)."""
        self._step.mixed_steps += steps

    def died(self, worker: str, cause: str, now: float, instance_id: int | None = None) -> None:
        """A worker's process died: `cause` says why in one line (what Ray reported). On the
        trace, an instant on the instance's track (the trainer's for any other worker)."""
        self.deaths.append({"worker": worker, "cause": cause, "at_s": round(now, 3)})
        if self.trace is not None:
            pid = TRAINER_PID if instance_id is None else instance_pid(instance_id)
            self.trace.instant(pid, f"{worker} died: {cause}", now, cause=cause)

    def reward_model_batch(self, size: int, seconds: float, start: float, end: float) -> None:
        """The reward model scored `size` samples in `seconds` (its own time), the batch out
        from `start` to `end` (run seconds): a slice on its track of the trace."""
        step = self._step
        step.reward_model_s += seconds
        step.reward_model_batches += 1
        if self.trace is not None:
            if not self.faults["reward_model_batches"]:
                self.trace.track(REWARD_MODEL_PID, "reward model")
            self.trace.slice(
                REWARD_MODEL_PID, 0, f"score {size}", start, end, size=size, seconds=seconds
            )
        self.faults["reward_model_batches"] += 1

    def reward_model_restarted(self, rescored: int, now: float) -> None:
        """A dead or stuck reward model was replaced; its batch of `rescored` goes again."""
        self.faults["reward_model_restarts"] += 1
        if self.trace is not None:
            name = f"reward model restarted ({rescored} samples scored again)"
            self.trace.instant(REWARD_MODEL_PID, name, now)

    def restarted(self, instance_id: int, requests: int, now: float) -> None:
        """A dead instance was replaced; its `requests` start again from their prompts."""
        self.faults["engine_restarts"] += 1
        self.faults["restarted_requests"] += requests
        if self.trace is not None:
            name = f"instance restarted ({requests} requests start again)"
            self.trace.instant(instance_pid(instance_id), name, now)

    def trainer_restarted(self, from_version: int, replayed_steps: int, now: float) -> None:
        """A dead trainer was replaced from `from_version`; `replayed_steps` are made again."""
        self.faults["trainer_restarts"] += 1
        self.faults["replayed_steps"] += replayed_steps
        if self.trace is not None:
            name = f"trainer restarted from v{from_version} ({replayed_steps} steps replayed)"
            self.trace.instant(TRAINER_PID, name, now)

    def replay_mismatch(self) -> None:
        """A replayed training step did not reproduce the original's loss exactly."""
        self.faults["replay_mismatches"] += 1

    def engine_setup(self, instance_id: int, setup: Mapping[str, Any]) -> None:
        """How an engine set itself up at start: what it runs, its KV pool, and the fast
        paths that failed their start-up check there (`fast_path_fallbacks`)."""
        self.engines[instance_id] = dict(setup)

    def lost(self, group_id: int, reason: str) -> None:
        """A runtime could not keep a group (e.g. an engine failed): reported as dropped."""
        self.groups.lost(group_id, reason)

    def carried(self, group_id: int) -> None:
        """A complete group a stopped run left queued, taken up by this one (`carried_in`)."""
        self.groups.carried(group_id)

    # ---- event handlers ------------------------------------------------------------------
    def _event_handlers(self) -> dict[type, Any]:
        return {
            ev.SampleDone: self._on_sample_done,
            ev.EnvWaiting: self._on_env_waiting,
            ev.EnvAnswered: self._on_env_answered,
            ev.WeightsLoaded: self.lanes.loaded,
            ev.MigrationDone: self._on_migrated,
            ev.TrainDone: self._on_train_done,
        }

    def _on_sample_done(self, e: ev.SampleDone) -> None:
        self.usage.finished(cmd.request_id(e.group_id, e.sample_index), e.now)
        self.groups.sample_done(e.group_id)

    def _on_env_waiting(self, e: ev.EnvWaiting) -> None:
        self._totals["env_waits"] += 1
        self.usage.waits(cmd.request_id(e.group_id, e.sample_index), e.now)

    def _on_env_answered(self, e: ev.EnvAnswered) -> None:
        self.usage.waits(cmd.request_id(e.group_id, e.sample_index), e.now, waiting=False)

    def _on_migrated(self, e: ev.MigrationDone) -> None:
        pending = self._migrating[(e.src, e.dst)]
        start, count = pending.popleft() if pending else (e.now, len(e.request_ids))
        if self.trace is not None:
            name = f"migrate {count} -> instance {e.dst}"
            self.trace.slice(instance_pid(e.src), MIGRATION_TID, name, start, e.now)

    def _on_train_done(self, e: ev.TrainDone) -> None:
        line = self._step_line(e.now, e.new_version)
        self.steps.append(line)
        self.files.metrics_row(line)
        if self.trace is not None:
            step = self._step
            name = f"train step {line['step']} (v{step.version} -> v{e.new_version})"
            start = e.now if step.train_start is None else step.train_start
            self.trace.slice(TRAINER_PID, 0, name, start, e.now, groups=step.groups)
            self._expert_counters(line, e.now)
        self._totals.update(
            step_time_s=line["step_time_s"],
            rollout_only_s=line["rollout_only_s"],
            tokens=line["consumed_tokens"],
        )
        self._staleness.update(self._step.staleness)
        self._step = self._new_step(e.now, list(self.usage.area))

    def _expert_counters(self, line: dict[str, Any], now: float) -> None:
        """An MoE step's expert load (the trainer's metrics) as counters on the trainer."""
        assert self.trace is not None
        if "moe_tokens_per_expert" in line:
            per_expert = {f"expert {e}": n for e, n in line["moe_tokens_per_expert"].items()}
            self.trace.counters(TRAINER_PID, "tokens per expert", now, per_expert)
        if "moe_imbalance" in line:
            self.trace.counter(TRAINER_PID, "expert imbalance", now, line["moe_imbalance"])

    def _new_step(self, start: float, area0: list[float]) -> _Step:
        return _Step(start, area0, overhead=dict.fromkeys(self.overhead_kinds, 0.0))

    # ---- command handlers ----------------------------------------------------------------
    def _command_handlers(self) -> dict[type, Any]:
        return {
            cmd.Dispatch: self._on_dispatch,
            cmd.LoadWeights: self.lanes.load_started,
            cmd.ReleaseVersion: lambda c, now: None,
            cmd.Migrate: self._on_migrate,
            cmd.Interrupt: lambda c, now: self.usage.parked(c.request_ids, c.instance_id, now),
            cmd.Resume: lambda c, now: self.usage.resumed(c.request_ids, c.instance_id, now),
            cmd.Offload: self._on_offload,
            cmd.Train: self._on_train,
            cmd.FilterGroup: lambda c, now: None,  # the runtime hands the group (`filtered`)
            cmd.DropGroup: lambda c, now: self.groups.lost(c.group_id, c.reason),
            cmd.SetTimer: lambda c, now: None,
            cmd.Finish: lambda c, now: None,
        }

    def _on_dispatch(self, c: cmd.Dispatch, now: float) -> None:
        self.groups.dispatched(c.group_id, len(c.sample_indices))
        rids = [cmd.request_id(c.group_id, s) for s in c.sample_indices]
        self.usage.placed(rids, c.instance_id, now)

    def _on_migrate(self, c: cmd.Migrate, now: float) -> None:
        moved = self.usage.moved(c.request_ids, c.src, c.dst, now)
        self._step.migrations += moved
        self._migrating[(c.src, c.dst)].append((now, moved))

    def _on_offload(self, c: cmd.Offload, now: float) -> None:
        self._step.offloads += 1

    def _on_train(self, c: cmd.Train, now: float) -> None:
        self._step.train_start = now
        self._step.version = c.version
        if self.trace is not None and now > self._step.start:
            self.trace.slice(TRAINER_PID, 0, "waiting for rollout", self._step.start, now)

    # ---- bookkeeping ---------------------------------------------------------------------
    def _busy_counter(self, instance: int, now: float, busy: int) -> None:
        if self.trace is not None:
            self.trace.counter(instance_pid(instance), "busy_slots", now, busy)

    def _consume_group(self, group: Group, version: int) -> None:
        self.groups.consumed(group.group_id)
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
            for name, value in sample.reward_parts.items():
                step.reward_parts.setdefault(name, []).append(value)
            if self.files.writes_trajectories:
                self.files.trajectory_row(self._trajectory(sample, group, version))

    def _trajectory(self, sample: Sample, group: Group, version: int) -> dict[str, Any]:
        return self._sample_row(sample, group, {"train_version": version})

    def _filtered_trajectory(self, sample: Sample, group: Group, step: int) -> dict[str, Any]:
        """A filtered group's sample: no train version, the step it was filtered at."""
        return self._sample_row(sample, group, {"filtered": True, "filtered_step": step})

    def _sample_row(self, sample: Sample, group: Group, fate: dict[str, Any]) -> dict[str, Any]:
        versions = sample.versions
        if self.run.mode == "partial_rollout" or (len(versions) and versions[0] != versions[-1]):
            behavior: int | list[int] = list(versions)
        else:
            behavior = versions[0] if len(versions) else group.version
        return (
            {
                "group_id": group.group_id,
                "sample_index": sample.sample_index,
                "prompt_id": sample.prompt_id,
                "behavior_version": behavior,
            }
            | fate
            | {
                "response_tokens": len(sample.response_ids),
                "reward": sample.reward,
                "migrations": sample.migrations,
                "offloads": sample.offloads,
            }
            | ({"reward_parts": sample.reward_parts} if sample.reward_parts else {})
            | ({"reward_info": sample.reward_info} if sample.reward_info else {})
            | ({"error": sample.reward_error} if sample.reward_error is not None else {})
            | (_turns(sample) if sample.turns else {})
            | (self.texts(sample) if self.texts is not None else {})
        )

    def _step_line(self, now: float, new_version: int) -> dict[str, Any]:
        step, run = self._step, self.run
        self.usage.settle(now)
        duration = now - step.start
        capacity = run.slots * duration
        util = [
            (a - a0) / capacity if capacity > 0 else 0.0
            for a, a0 in zip(self.usage.area, step.area0, strict=True)
        ]
        train_start = step.train_start if step.train_start is not None else now
        line: dict[str, Any] = {
            "step": run.first_version + len(self.steps),
            "version": step.version,
            "new_version": new_version,
            "time_s": now,
            "step_time_s": duration,
            "rollout_only_s": train_start - step.start,
            "train_time_s": now - train_start,
            "consumed_groups": step.groups,
            "filtered_groups": step.filtered,
            "consumed_tokens": step.tokens,
            "tokens_per_s": step.tokens / duration if duration > 0 else 0.0,
            "reward_mean": sum(step.rewards) / len(step.rewards) if step.rewards else 0.0,
            "staleness": {str(s): n for s, n in sorted(step.staleness.items())},
            "instances_per_version": self.lanes.per_version(),
            "overhead_s": dict(step.overhead),
            "overhead_share": {
                k: _share(v, duration * run.num_instances) for k, v in step.overhead.items()
            },
            "slot_utilization": sum(util) / len(util),
            "slot_utilization_per_instance": util,
            "reprefill_tokens": step.reprefill,
            "prefill_tokens": step.prefill,
            "prefill_saved_tokens": step.prefill_saved,
            "prefix_hit_rate": prefix_hit_rate(step.prefill, step.prefill_saved),
            "cached_blocks": sum(self._cached_blocks.values()),
            "migrations": step.migrations,
            "offloads": step.offloads,
            "mixed_version_steps": step.mixed_steps,
        }
        self._totals.update({f"overhead_{k}": v for k, v in step.overhead.items()})
        self._totals.update(
            reprefill=step.reprefill, migrations=step.migrations, offloads=step.offloads,
            prefill=step.prefill, prefill_saved=step.prefill_saved,
            mixed_steps=step.mixed_steps,
        )  # fmt: skip
        line |= _reward_model_line(step)
        if step.reward_parts:  # each part's mean over the responses it was scored on
            line["reward_parts"] = {k: sum(v) / len(v) for k, v in step.reward_parts.items()}
        return line | step.extra

    # ---- end of run ----------------------------------------------------------------------
    def close(self, now: float) -> dict[str, Any]:
        """Write summary.json (and trace.json); returns the summary."""
        self.usage.settle(now)
        self.lanes.close(now)
        self.summary = self._summary(now) | self._reward_model_summary()
        self.files.close(self.summary, self.trace)
        return self.summary

    def _summary(self, wall: float) -> dict[str, Any]:
        states, totals, run = self.groups.states(), self._totals, self.run
        counts, dropped, faults = self.groups.counts, self.groups.dropped, self.faults
        return {
            "mode": run.mode,
            "K": run.k,
            "steps": len(self.steps),
            "dispatched": counts["dispatched"],
            "completed": counts["completed"],
            "consumed": counts["consumed"],
            "filtered": counts["filtered"],
            "carried_in": counts["carried_in"],
            "in_flight_at_end": states["running"],
            "queued_at_end": states["complete"],
            "dropped": dict(dropped),
            "dropped_total": sum(dropped.values()),
            "wall_time_s": wall,
            "consumed_tokens": totals["tokens"],
            "throughput_tokens_per_s": _share(totals["tokens"], wall),
            "mean_step_time_s": _share(totals["step_time_s"], len(self.steps)),
            "rollout_only_share": _share(totals["rollout_only_s"], totals["step_time_s"]),
            "slot_utilization": _share(sum(self.usage.area), wall * run.slots * run.num_instances),
            # episodes waiting for their environment hold a request but no slot: an instance
            # may hold more requests than slots (up to orchestrator.episode_overcommit x)
            "peak_requests_held": max(self.usage.peak_held, default=0),
            "env_waits": totals["env_waits"],
            "overhead_share": {
                k: _share(totals[f"overhead_{k}"], wall * run.num_instances)
                for k in run.overhead_kinds
            },
            "staleness": {str(s): n for s, n in sorted(self._staleness.items())},
            "migrations": totals["migrations"],
            "offloads": totals["offloads"],
            "mixed_version_steps": totals["mixed_steps"],
            "reprefill_tokens": totals["reprefill"],
            "prefill_tokens": totals["prefill"],
            "prefill_saved_tokens": totals["prefill_saved"],
            "prefix_hit_rate": prefix_hit_rate(totals["prefill"], totals["prefill_saved"]),
            "engine_restarts": faults["engine_restarts"],
            "restarted_requests": faults["restarted_requests"],
            "trainer_restarts": faults["trainer_restarts"],
            "replayed_steps": faults["replayed_steps"],
            "replay_mismatches": faults["replay_mismatches"],
            "deaths": list(self.deaths),
        } | self._engine_summary()

    def _reward_model_summary(self) -> dict[str, Any]:
        """A run with a reward model: its batches and restarts."""
        faults = self.faults
        if not faults["reward_model_batches"] and not faults["reward_model_restarts"]:
            return {}
        return {
            "reward_model_batches": faults["reward_model_batches"],
            "reward_model_restarts": faults["reward_model_restarts"],
        }

    def _engine_summary(self) -> dict[str, Any]:
        """The engines' set-ups and, flat, every fast-path fallback (none: an empty list)."""
        if not self.engines:
            return {}
        ordered = sorted(self.engines.items())
        fallbacks = [
            {"instance": iid, **fallback}
            for iid, setup in ordered
            for fallback in setup.get("fast_path_fallbacks", [])
        ]
        return {"engines": {str(i): e for i, e in ordered}, "fast_path_fallbacks": fallbacks}


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0


def _turns(sample: Sample) -> dict[str, Any]:
    """A multi-turn sample's turns: how many, per turn its sampled and observed tokens (a new
    segment's prompt is the observation of the turn before it), its segments, and (a chat
    episode's) its tool calls and those answered with an error."""
    row: dict[str, Any] = {
        "turns": len(sample.turns),
        "turn_tokens": [t.sampled for t in sample.turns],
        "observation_tokens": [t.observed for t in sample.turns],
        "segments": sample.num_segments,
    }
    if any(t.tool_calls for t in sample.turns):
        row["tool_calls"] = sum(t.tool_calls for t in sample.turns)
        row["tool_call_errors"] = sum(t.tool_errors for t in sample.turns)
    return row


def _reward_model_line(step: _Step) -> dict[str, Any]:
    """A step's reward model figures (none when it scored no batch)."""
    if not step.reward_model_batches:
        return {}
    return {
        "reward_model_s": step.reward_model_s,
        "reward_model_batches": step.reward_model_batches,
        "reward_model_batch_s": step.reward_model_s / step.reward_model_batches,
    }
