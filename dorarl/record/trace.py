"""Chrome trace-event builder (opens in Perfetto / chrome://tracing): one process per track.

Times go in as seconds since run start and come out as microseconds. Process 0 is the
trainer (with, for an MoE model, counters of each step's tokens per expert and its expert
imbalance); instance i is process i + 1, with threads for its hosted version, weight loads
and migrations, and a `busy_slots` counter. A run with a reward model has its track too
(`REWARD_MODEL_PID`): a slice per batch scored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TRAINER_PID = 0
REWARD_MODEL_PID = 10_000  # past any instance's
VERSION_TID, WEIGHTS_TID, MIGRATION_TID = 0, 1, 2
_THREADS = {VERSION_TID: "hosted version", WEIGHTS_TID: "weight loads", MIGRATION_TID: "migrations"}


def instance_pid(instance_id: int) -> int:
    return instance_id + 1


class TraceBuilder:
    def __init__(self, num_instances: int) -> None:
        self.events: list[dict[str, Any]] = _process_name(TRAINER_PID, "trainer")
        self.events.append(_thread_name(TRAINER_PID, 0, "steps"))
        for i in range(num_instances):
            pid = instance_pid(i)
            self.events += _process_name(pid, f"instance {i}")
            self.events += [_thread_name(pid, tid, name) for tid, name in _THREADS.items()]

    def slice(self, pid: int, tid: int, name: str, start: float, end: float, **args: Any) -> None:
        event = {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": _us(start)}
        event["dur"] = max(0.0, _us(end) - _us(start))
        if args:
            event["args"] = args
        self.events.append(event)

    def track(self, pid: int, name: str) -> None:
        """Name process `pid` (a track added during the run, as the reward model's)."""
        self.events += _process_name(pid, name)

    def counter(self, pid: int, name: str, at: float, value: float) -> None:
        self.counters(pid, name, at, {name: value})

    def counters(self, pid: int, name: str, at: float, values: dict[str, float]) -> None:
        """One counter track with a series per key (Perfetto stacks them)."""
        self.events.append(
            {"name": name, "ph": "C", "pid": pid, "ts": _us(at), "args": dict(values)}
        )

    def instant(self, pid: int, name: str, at: float, **args: Any) -> None:
        event = {"name": name, "ph": "i", "s": "p", "pid": pid, "tid": 0, "ts": _us(at)}
        if args:
            event["args"] = args
        self.events.append(event)

    def write(self, path: Path) -> None:
        write_events(path, self.events)


def write_events(path: Path, events: list[dict[str, Any]]) -> None:
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def read_events(path: Path) -> list[dict[str, Any]]:
    data = json.loads(path.read_text())
    return data["traceEvents"] if isinstance(data, dict) else data


def shifted(event: dict[str, Any], seconds: float) -> dict[str, Any]:
    """`event` `seconds` later (metadata events have no time to shift)."""
    if event.get("ph") == "M":
        return event
    return event | {"ts": round(event["ts"] + _us(seconds), 3)}


def marker(name: str, at: float, **args: Any) -> dict[str, Any]:
    """An instant across every track (Perfetto draws it as a line through the timeline)."""
    event = {"name": name, "ph": "i", "s": "g", "pid": TRAINER_PID, "tid": 0, "ts": _us(at)}
    if args:
        event["args"] = args
    return event


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _process_name(pid: int, name: str) -> list[dict[str, Any]]:
    meta = {"ph": "M", "pid": pid, "tid": 0, "ts": 0}
    return [
        meta | {"name": "process_name", "args": {"name": name}},
        meta | {"name": "process_sort_index", "args": {"sort_index": pid}},
    ]


def _thread_name(pid: int, tid: int, name: str) -> dict[str, Any]:
    return {
        "name": "thread_name",
        "ph": "M",
        "pid": pid,
        "tid": tid,
        "ts": 0,
        "args": {"name": name},
    }
