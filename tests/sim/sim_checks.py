"""Checks of a finished simulation from its output files and from the controller's state."""

from __future__ import annotations

import bisect
import json
import re
from collections import defaultdict
from pathlib import Path

from dorarl.controller import Controller, ControllerConfig
from dorarl.sim import RewardModel, RunResult


class InvariantWatch:
    """Observer: runs the controller's invariant checks after every event."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.events = 0

    def __call__(self, controller: Controller, event, commands) -> None:
        self.events += 1
        if controller.finished or len(self.problems) > 5:
            return
        found = controller.violations()
        if found:
            self.problems.append(f"after {event}: {found}")


def check_run(
    result: RunResult, cfg: ControllerConfig, rewards: RewardModel | None = None, seed: int = 0
) -> None:
    out = Path(result.out_dir)
    summary = json.loads((out / "summary.json").read_text())
    assert summary == result.summary
    _check_summary(summary, result.controller, cfg)
    rows = _check_metrics(out, cfg, summary)
    trajectories = _check_trajectories(out, cfg)
    _check_filtering(trajectories, rows, cfg, rewards or RewardModel(), seed)
    _check_trace(out, cfg)


def _check_summary(summary: dict, controller: Controller, cfg: ControllerConfig) -> None:
    counts = controller.counts()
    steps = cfg.steps - cfg.initial_version
    assert summary["steps"] == steps
    assert summary["dropped_total"] == 0, summary["dropped"]
    assert summary["consumed"] == steps * cfg.tbs == counts["consumed"]
    assert summary["dispatched"] == counts["dispatched"]
    assert summary["completed"] == counts["completed"]
    assert summary["in_flight_at_end"] == counts["in_flight"]
    assert summary["queued_at_end"] == counts["queued"]
    assert summary["filtered"] == counts["filtered"]
    if not cfg.rollout.filter_groups:
        assert summary["filtered"] == 0
    # the audit: every dispatched group is trained, filtered, in flight or queued, once
    ended = summary["consumed"] + summary["filtered"]
    parts = ended + summary["in_flight_at_end"] + summary["queued_at_end"]
    assert summary["dispatched"] == parts


def _check_metrics(out: Path, cfg: ControllerConfig, summary: dict) -> list[dict]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(cfg.initial_version, cfg.steps))
    # every filtered group lands in the row of the version newest when it was filtered
    assert sum(m["filtered_groups"] for m in lines) == summary["filtered"]
    cap = cfg.rollout.max_filtered_per_step if cfg.rollout.filter_groups else 0
    assert all(0 <= m["filtered_groups"] <= cap for m in lines)
    for m in lines:
        assert m["consumed_groups"] == cfg.tbs
        assert all(0 <= int(s) <= cfg.effective_K for s in m["staleness"])
        assert sum(m["staleness"].values()) == cfg.tbs
        assert m["new_version"] == m["version"] + 1 == m["step"] + 1
        assert abs(m["rollout_only_s"] + m["train_time_s"] - m["step_time_s"]) < 1e-6
        assert 0.0 <= m["slot_utilization"] <= 1.0 + 1e-9
        assert sum(m["instances_per_version"].values()) == cfg.instances
    return lines


def _check_trajectories(out: Path, cfg: ControllerConfig) -> dict[int, list[dict]]:
    """Trained rows keep Eq. 1; returns every group's rows (trained and filtered)."""
    bound = cfg.effective_K
    every: dict[int, list[dict]] = defaultdict(list)
    groups: dict[int, list[dict]] = defaultdict(list)
    for line in (out / "trajectories.jsonl").read_text().splitlines():
        t = json.loads(line)
        every[t["group_id"]].append(t)
        if t.get("filtered"):
            continue
        groups[t["group_id"]].append(t)
        versions = t["behavior_version"]
        if cfg.mode == "partial_rollout":
            assert len(versions) == t["response_tokens"] and versions == sorted(versions)
            assert 0 <= t["train_version"] - min(versions) <= bound
            assert max(versions) <= t["train_version"]
        else:
            assert isinstance(versions, int), "one-version modes must record one version"
            assert 0 <= t["train_version"] - versions <= bound
    assert len(groups) == (cfg.steps - cfg.initial_version) * cfg.tbs
    for trajectories in groups.values():
        assert sorted(t["sample_index"] for t in trajectories) == list(range(cfg.group_size))
        assert len({t["train_version"] for t in trajectories}) == 1
        if cfg.mode != "partial_rollout":
            assert len({t["behavior_version"] for t in trajectories}) == 1
    return every


def _check_filtering(
    groups: dict[int, list[dict]],
    rows: list[dict],
    cfg: ControllerConfig,
    rewards: RewardModel,
    seed: int,
) -> None:
    """Each group is trained once or filtered once, never both; a filtered group is complete
    and uniform, of a window version at the step it was filtered; a uniform group is trained
    only in a run that used up some version's budget; rewards are the reward model's."""
    capped = any(m["filtered_groups"] == cfg.rollout.max_filtered_per_step for m in rows)
    for gid, trajectories in groups.items():
        fates = {bool(t.get("filtered")) for t in trajectories}
        assert len(fates) == 1, f"group {gid} both trained and filtered"
        assert sorted(t["sample_index"] for t in trajectories) == list(range(cfg.group_size))
        model = rewards.group_rewards(seed, gid, cfg.group_size)
        assert [t["reward"] for t in sorted(trajectories, key=lambda t: t["sample_index"])] == model
        uniform = len(set(model)) == 1
        if fates == {True}:
            assert cfg.rollout.filter_groups and uniform
            _check_filtered_group(trajectories, cfg)
        elif cfg.rollout.filter_groups and uniform:
            assert capped, f"uniform group {gid} trained while the budget was never used up"


def _check_filtered_group(trajectories: list[dict], cfg: ControllerConfig) -> None:
    (step,) = {t["filtered_step"] for t in trajectories}
    assert cfg.initial_version <= step < cfg.steps
    assert all("train_version" not in t for t in trajectories)
    for t in trajectories:
        versions = t["behavior_version"]
        oldest = min(versions) if isinstance(versions, list) else versions
        assert step - cfg.effective_K <= oldest <= step  # outstanding groups sit in the window


# The trace stores times in microseconds rounded to 1 ns and a slice as start + duration, so a
# slice's end read back as start + dur can miss the instant it was written by one rounding.
TRACE_RESOLUTION_US = 1e-3


def _check_trace(out: Path, cfg: ControllerConfig) -> None:
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    published = sorted(
        (e["ts"] + e["dur"], int(m.group(1)))
        for e in events
        if e.get("pid") == 0 and (m := re.search(r"-> v(\d+)\)", e["name"]))
    )
    times = [t for t, _ in published]

    def newest(ts: float, strictly_before: bool = False) -> int:
        idx = bisect.bisect_left(times, ts) if strictly_before else bisect.bisect_right(times, ts)
        return published[idx - 1][1] if idx else cfg.initial_version

    hosted = defaultdict(list)  # pid -> [(start, end, version)]
    busy = defaultdict(list)  # pid -> [(ts, value)]
    for e in events:
        if e["ph"] == "X" and e.get("tid") == 0 and e["pid"] > 0:
            hosted[e["pid"]].append((e["ts"], e["ts"] + e["dur"], int(e["name"][1:])))
        elif e["ph"] == "C":
            busy[e["pid"]].append((e["ts"], e["args"]["busy_slots"]))
    for pid, slices in hosted.items():
        for start, _, version in slices:
            assert version <= newest(start), f"instance {pid - 1} hosted unpublished v{version}"
        points = busy[pid]
        for idx, (ts, value) in enumerate(points):
            if value == 0:
                continue
            end = points[idx + 1][0] if idx + 1 < len(points) else ts
            # the newest slice holding ts: with several versions per instance one version's
            # lane ends where the next begins
            version = next(
                (v for s, e, v in reversed(slices) if s <= ts <= e + TRACE_RESOLUTION_US), None
            )
            assert version is not None, f"instance {pid - 1} busy at {ts} with no hosted version"
            low = newest(end, strictly_before=True) - cfg.effective_K
            assert version >= low, f"instance {pid - 1} ran v{version} outside the window at {end}"
