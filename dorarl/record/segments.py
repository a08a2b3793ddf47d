"""A run's segments, one per process that ran it (the first, then each resume), and the run's
summary.json and trace.json rebuilt from them, so both describe the whole run.

Each segment keeps its records in segments/NNN/: segment.json as it starts, its recorder's
summary.json and trace.json as it ends (stopped, finished or failed). A segment killed
before its end loses only its own summary and trace, never another's. A segment's steps
are the metrics.jsonl rows from its start version to the next segment's: a resume from
version V moves later rows aside, and the segments that started at V or later with them.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dorarl.engine.outputs import prefix_hit_rate
from dorarl.record.evaluations import held_out_count, read_evaluations, sampled_eval_summary
from dorarl.record.pacing import PaceStats
from dorarl.record.trace import marker, read_events, shifted, write_events
from dorarl.run_layout import SEGMENT_START_FILE as START_FILE
from dorarl.run_layout import SUMMARY_FILE, TRACE_FILE, RunFolder

KILLED = "killed"  # how a segment ended that never wrote its summary (the others write it)


@dataclass(frozen=True)
class Segment:
    """One segment as its records and the run's history show it."""

    index: int
    folder: Path
    start_version: int
    opened_at: float  # seconds since the epoch, as the process set the segment up
    instances: int
    slots: int
    summary: dict[str, Any] | None  # its own summary; None when killed before writing it
    rows: list[dict[str, Any]]  # its metrics rows that the history keeps
    # the run's group counts up to the stop checkpoint this one resumed from (`run_books`)
    resumed_books: dict[str, Any] | None = None

    @property
    def ended(self) -> str:
        return (self.summary or {}).get("ended", KILLED)

    @property
    def end_version(self) -> int:
        return self.rows[-1]["new_version"] if self.rows else self.start_version

    @property
    def intact(self) -> bool:
        """Its own summary covers exactly the steps the history keeps of it."""
        return self.summary is not None and self.summary["steps"] == len(self.rows)

    @property
    def wall_time_s(self) -> float:
        """Its run time in the history: to the end of its last kept step, unless intact."""
        if self.intact:
            return self.summary["wall_time_s"]
        return self.rows[-1]["time_s"] if self.rows else 0.0

    @property
    def started_at(self) -> float:
        """When its clock started (seconds since the epoch); a killed one's is when it was
        set up, a little earlier."""
        return (self.summary or {}).get("started_at", self.opened_at)

    @property
    def slot_utilization(self) -> float:
        if self.intact:
            return self.summary["slot_utilization"]
        busy = sum(r["slot_utilization"] * r["step_time_s"] for r in self.rows)
        return _share(busy, self.wall_time_s)

    def entry(self) -> dict[str, Any]:
        """Its line in the run summary's `segments`."""
        entry = {
            "segment": self.index,
            "start_version": self.start_version,
            "end_version": self.end_version,
            "steps": len(self.rows),
            "wall_time_s": self.wall_time_s,
            "started_at": self.started_at,
            "ended": self.ended,
        }
        if "stopped_by" in (self.summary or {}):
            entry["stopped_by"] = self.summary["stopped_by"]
        return entry


# ---- a segment's records -----------------------------------------------------------------
def open_segment(
    out_dir: Path,
    start_version: int,
    instances: int,
    slots: int,
    resumed_books: dict[str, Any] | None = None,
) -> Path:
    """The folder of a new segment of the run in `out_dir`, its start recorded (with the
    run's group counts its checkpoint holds, `run_books`, when it has them)."""
    run = RunFolder(out_dir)
    index = 1 + max((int(p.name) for p in _folders(run.segments)), default=-1)
    folder = run.segment(index)
    folder.mkdir(parents=True)
    start = {"start_version": start_version, "opened_at": time.time()}
    start |= {"instances": instances, "slots": slots}
    if resumed_books is not None:
        start["resumed_books"] = resumed_books
    (folder / START_FILE).write_text(json.dumps(start, indent=2) + "\n")
    return folder


def end_segment(folder: Path, summary: dict[str, Any], ended: str, started_at: float) -> None:
    """Write the segment's summary: how it `ended`, when its clock started."""
    record = summary | {"ended": ended, "started_at": started_at}
    (folder / SUMMARY_FILE).write_text(json.dumps(record, indent=2) + "\n")


def roll_back_segments(out_dir: Path, aside: Path, version: int) -> int:
    """Move the segments that started at `version` or later (every step of theirs made a
    version after it) to the segments of `aside` (a rolled-back run folder); returns how
    many moved."""
    moved = 0
    for folder in _folders(RunFolder(out_dir).segments):
        if _start(folder)["start_version"] >= version:
            dest = _free(RunFolder(aside).segments / folder.name)
            dest.parent.mkdir(parents=True, exist_ok=True)
            folder.rename(dest)
            moved += 1
    return moved


def read_segments(out_dir: Path, rows: Sequence[dict[str, Any]]) -> list[Segment]:
    """The run's segments in order, each with its rows of the history `rows`."""
    folders = _folders(RunFolder(out_dir).segments)
    starts = [_start(f) for f in folders]
    bounds = [s["start_version"] for s in starts[1:]] + [float("inf")] * bool(starts)
    segments = []
    for folder, start, end in zip(folders, starts, bounds, strict=True):
        mine = [r for r in rows if start["start_version"] < r["new_version"] <= end]
        summary_path = folder / SUMMARY_FILE
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
        segments.append(Segment(int(folder.name), folder, summary=summary, rows=mine, **start))
    return segments


def run_times(segments: Sequence[Segment]) -> list[float]:
    """When each kept step ended on the run's clock: the segments' run times end to end
    (not the time between them, when nothing ran)."""
    times: list[float] = []
    before = 0.0
    for segment in segments:
        times += [before + r["time_s"] for r in segment.rows]
        before += segment.wall_time_s
    return times


# ---- the whole run -----------------------------------------------------------------------
def write_run_records(out_dir: Path) -> dict[str, Any]:
    """Rebuild the run's summary.json and trace.json from the segments and its evaluations;
    returns the summary."""
    run = RunFolder(out_dir)
    segments = read_segments(out_dir, _rows(run.metrics))
    summary = run_summary(segments, read_evaluations(run.evaluations))
    run.summary.write_text(json.dumps(summary, indent=2) + "\n")
    if any((s.folder / TRACE_FILE).is_file() for s in segments):
        write_events(run.trace, run_trace(segments))
    return summary


# Fields of a segment's summary that describe where the run stands (and how its start went):
# the last segment's.
LAST = ("in_flight_at_end", "queued_at_end", "stopped_by", "stopped_at_version",
        "resume_command", "startup")  # fmt: skip
# Work that only a segment's own books count: summed (a killed segment's is unknown, 0,
# unless a later segment resumed from a stop checkpoint holding the run's counts up to it),
# rolled-back work included.
GROUP_COUNTS = ("dispatched", "completed", "consumed", "filtered", "carried_in")
SUMMED = (*GROUP_COUNTS, "env_waits")
FAULTS = ("engine_restarts", "restarted_requests", "trainer_restarts", "replayed_steps",
          "replay_mismatches", "reward_errors", "env_errors", "agent_refused_calls",
          "context_overflows")  # fmt: skip
REWARD_MODEL = ("reward_model_batches", "reward_model_restarts")


def run_books(before: dict[str, Any] | None, summary: dict[str, Any]) -> dict[str, Any]:
    """The run's group counts at a segment's end: those its start checkpoint held of the run
    (`before`; {} for a fresh run) plus the segment's own (its summary's)."""
    books = {key: before.get(key, 0) + summary.get(key, 0) for key in GROUP_COUNTS}
    dropped = Counter(before.get("dropped", {})) + Counter(summary.get("dropped", {}))
    return books | {"dropped": dict(dropped)}


def _books(segments: Sequence[Segment]) -> list[dict[str, Any]]:
    """What the run's group counts add up from: every segment's own, or, from the last one
    that resumed from a stop checkpoint holding the run's counts, those counts (the segments
    before it, a killed or rolled-back one included, as that checkpoint saw them) and its
    own and later ones'."""
    own = [s.summary or {} for s in segments]
    held = [i for i, s in enumerate(segments) if s.resumed_books is not None]
    if not held:
        return own
    return [segments[held[-1]].resumed_books or {}, *own[held[-1] :]]


def _engine_setups(segments: Sequence[Segment]) -> dict[str, Any]:
    """The newest segment's engine set-ups (the engines the run ended with), and every
    segment's fast-path fallbacks, each marked with its segment."""
    reported = [s for s in segments if s.summary is not None and "engines" in s.summary]
    if not reported:
        return {}
    fallbacks = [
        {"segment": s.index, **fallback}
        for s in reported
        for fallback in s.summary.get("fast_path_fallbacks", [])
    ]
    return {"engines": reported[-1].summary["engines"], "fast_path_fallbacks": fallbacks}


def run_summary(
    segments: Sequence[Segment], evaluations: dict[int, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The whole run's summary. Per field: mode and K from the newest segment's summary;
    `LAST` from the last segment's; `SUMMED`, drops and `FAULTS` summed over the segments'
    summaries; steps, tokens, step times, staleness, migrations, offloads and re-prefill
    recomputed from the history's rows, which hold each kept step once; wall time summed
    over the segments' run times (`Segment.wall_time_s`), and the throughput, slot
    utilization and overhead shares taken over it (the group counts as `_books` finds them); `evaluations` (the run's
    evaluations.jsonl, by version) of the versions the history keeps, over those a run
    folder written before that file carries in its segments' summaries; the engines'
    set-ups and fast-path
    fallbacks (`_engine_setups`); plus each segment's line (`segments`)."""
    rows = [r for s in segments for r in s.rows]
    own = [s.summary for s in segments if s.summary is not None]
    newest = own[-1] if own else {}
    last = (segments[-1].summary or {}) if segments else {}
    wall = sum(s.wall_time_s for s in segments)
    tokens = sum(r["consumed_tokens"] for r in rows)
    step_time = sum(r["step_time_s"] for r in rows)
    books = _books(segments)
    dropped = sum((Counter(s.get("dropped", {})) for s in books), Counter())
    summary: dict[str, Any] = {"mode": newest.get("mode"), "K": newest.get("K"), "steps": len(rows)}
    summary |= {key: sum(s.get(key, 0) for s in books) for key in GROUP_COUNTS}
    summary["env_waits"] = sum(s.get("env_waits", 0) for s in own)
    summary |= {key: last[key] for key in LAST if key in last}
    summary |= _engine_setups(segments)
    summary |= {
        "dropped": dict(dropped),
        "dropped_total": sum(dropped.values()),
        "wall_time_s": wall,
        "consumed_tokens": tokens,
        "throughput_tokens_per_s": _share(tokens, wall),
        "mean_step_time_s": _share(step_time, len(rows)),
        "rollout_only_share": _share(sum(r["rollout_only_s"] for r in rows), step_time),
        "slot_utilization": _slot_utilization(segments),
        "overhead_share": _overhead_share(segments, list(newest.get("overhead_share", {}))),
        "staleness": _staleness(rows),
    }
    summary |= {key: sum(r[key] for r in rows) for key in ("migrations", "offloads")}
    summary["mixed_version_steps"] = sum(r.get("mixed_version_steps", 0) for r in rows)
    summary["reprefill_tokens"] = sum(r["reprefill_tokens"] for r in rows)
    summary |= _prefill(rows)
    summary |= {key: sum(s.get(key, 0) for s in own) for key in FAULTS}
    summary |= _reward_model(own)
    summary["deaths"] = [death for s in own for death in s.get("deaths", [])]
    summary["peak_requests_held"] = max((s.get("peak_requests_held", 0) for s in own), default=0)
    summary |= _evaluations(segments, evaluations or {})
    pace = _pace([s["pace"] for s in own if "pace" in s])
    return summary | ({"pace": pace} if pace else {}) | {"segments": [s.entry() for s in segments]}


def _reward_model(own: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A run with a reward model: its batches and restarts summed over the segments."""
    if not any(key in s for s in own for key in REWARD_MODEL):
        return {}
    return {key: sum(s.get(key, 0) for s in own) for key in REWARD_MODEL}


def _prefill(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Prompt tokens computed and saved by the prefix cache (0 in rows written without)."""
    computed = sum(r.get("prefill_tokens", 0) for r in rows)
    saved = sum(r.get("prefill_saved_tokens", 0) for r in rows)
    return {
        "prefill_tokens": computed,
        "prefill_saved_tokens": saved,
        "prefix_hit_rate": prefix_hit_rate(computed, saved),
    }


def _slot_utilization(segments: Sequence[Segment]) -> float:
    """Busy slot-seconds over slot-seconds, every segment weighted by its capacity."""
    capacity = [s.wall_time_s * s.instances * s.slots for s in segments]
    busy = sum(s.slot_utilization * c for s, c in zip(segments, capacity, strict=True))
    return _share(busy, sum(capacity))


def _overhead_share(segments: Sequence[Segment], kinds: list[str]) -> dict[str, float]:
    """Instance-seconds of each overhead over the run's instance-seconds."""
    rows = [r for s in segments for r in s.rows]
    instance_s = sum(s.wall_time_s * s.instances for s in segments)
    return {k: _share(sum(r["overhead_s"].get(k, 0.0) for r in rows), instance_s) for k in kinds}


def _staleness(rows: Sequence[dict[str, Any]]) -> dict[str, int]:
    total: Counter = Counter()
    for r in rows:
        total.update({int(s): n for s, n in r["staleness"].items()})
    return {str(s): total[s] for s in sorted(total)}


def _evaluations(
    segments: Sequence[Segment], evaluations: dict[int, dict[str, Any]]
) -> dict[str, Any]:
    """The run summary's evaluations: per segment, of the versions the history keeps of it
    (a later segment's result of the same version wins: the resumed start is evaluated
    again); the evaluations file's over the segments' summaries' (older run folders)."""
    accuracy: dict[int, float] = {}
    sampled: dict[int, dict[str, float]] = {}
    for s in segments:
        own = s.summary or {}
        kept = range(s.start_version, s.end_version + 1)
        accuracy |= {int(v): a for v, a in own.get("eval", {}).items() if int(v) in kept}
        sampled |= {int(v): x for v, x in own.get("eval_sampled", {}).items() if int(v) in kept}
    kept = {v for s in segments for v in range(s.start_version, s.end_version + 1)}
    results = [r for v, r in evaluations.items() if v in kept]
    accuracy |= {int(r["version"]): r["accuracy"] for r in results}
    sampled |= {int(v): x for v, x in sampled_eval_summary(results).get("eval_sampled", {}).items()}
    out: dict[str, Any] = {"eval": {str(v): accuracy[v] for v in sorted(accuracy)}}
    out |= eval_ends(accuracy)
    n = held_out_count(results)
    if n is not None:  # the held-out prompts each accuracy is a share of
        out["eval_n"] = n
    if sampled:
        out["eval_sampled"] = {str(v): sampled[v] for v in sorted(sampled)}
    return out


def eval_ends(accuracy: dict[int, float]) -> dict[str, Any]:
    """The first evaluation's version and accuracy, and the last's when it is of a later
    version: a run stopped after its first evaluation has no last to report."""
    if not accuracy:
        return {}
    first, last = min(accuracy), max(accuracy)
    ends = {"eval_version_first": first, "eval_accuracy_first": accuracy[first]}
    if last > first:
        ends |= {"eval_version_last": last, "eval_accuracy_last": accuracy[last]}
    return ends


def _pace(totals: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Paced work summed over the segments that were paced, engines and trainer apart."""
    merged: dict[str, PaceStats] = {}
    for total in totals:
        for kind, values in total.items():
            stats = PaceStats(**{k: v for k, v in values.items() if k != "over_share"})
            merged.setdefault(kind, PaceStats()).merge(stats)
    return {kind: stats.to_dict() for kind, stats in merged.items()}


def run_trace(segments: Sequence[Segment]) -> list[dict[str, Any]]:
    """Every segment's trace events on one timeline: each shifted by the wall-clock time
    from the first segment's start to its own (never onto the one before, should the
    clock have been set back), with a marker where each starts."""
    meta: dict[str, dict[str, Any]] = {}
    events: list[dict[str, Any]] = []
    first = segments[0].started_at if segments else 0.0
    floor = 0.0
    for s in segments:
        offset = max(s.started_at - first, floor)
        ran = (s.summary or {}).get("wall_time_s", s.wall_time_s)
        floor = offset + ran
        name = f"segment {s.index}: v{s.start_version} -> v{s.end_version}, {s.ended}"
        events.append(marker(name, offset, **s.entry()))
        path = s.folder / TRACE_FILE
        for event in read_events(path) if path.is_file() else []:
            if event.get("ph") == "M":  # track names: each segment names its tracks again
                meta.setdefault(json.dumps(event, sort_keys=True), event)
            else:
                events.append(shifted(event, offset))
    return list(meta.values()) + events


# ---- helpers -----------------------------------------------------------------------------
def _folders(parent: Path) -> list[Path]:
    found = [p for p in parent.glob("[0-9]*") if p.name.isdigit() and (p / START_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name))


def _start(folder: Path) -> dict[str, Any]:
    return json.loads((folder / START_FILE).read_text())


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _free(path: Path) -> Path:
    """`path`, or `path`-1, -2, ... when taken (a segment number rolled back before)."""
    candidate, n = path, 0
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0
