"""PNG views of a mode run: instance lanes over time coloured by version, and throughput.

`plot_timeline` reads only the recorder's trace.json: each instance lane is filled to its
busy-slot share in the colour of the version it hosts, so idle slots (bubbles) stay
white; weight loads are hatched; the trainer lane shows training steps and the time it
waited for rollout.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from dorarl.record.trace import MIGRATION_TID, TRAINER_PID, VERSION_TID, WEIGHTS_TID  # noqa: E402

LANE = 0.8  # lane height; lanes sit one unit apart


@dataclass
class Span:
    start: float  # seconds
    end: float
    name: str


@dataclass
class TraceView:
    """What the timeline needs from a Chrome trace, times in seconds."""

    versions: dict[int, list[Span]]  # instance -> hosted-version spans ("v3")
    loads: dict[int, list[Span]]
    migrations: dict[int, list[Span]]
    busy: dict[int, list[tuple[float, float]]]  # instance -> (time, busy slots) changes
    trainer: list[Span]


def read_trace(path: str | Path) -> TraceView:
    data = json.loads(Path(path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    tracks: dict[tuple[int, int], list[Span]] = defaultdict(list)
    busy: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            start = e["ts"] / 1e6
            tracks[(e["pid"], e["tid"])].append(Span(start, start + e["dur"] / 1e6, e["name"]))
        elif e.get("ph") == "C" and e.get("name") == "busy_slots":
            busy[e["pid"] - 1].append((e["ts"] / 1e6, float(e["args"]["busy_slots"])))
    instances = {pid - 1 for pid, _ in tracks if pid != TRAINER_PID} | set(busy)

    def lane(tid: int) -> dict[int, list[Span]]:
        return {i: sorted(tracks.get((i + 1, tid), []), key=lambda s: s.start) for i in instances}

    for changes in busy.values():
        changes.sort()
    return TraceView(
        versions=lane(VERSION_TID),
        loads=lane(WEIGHTS_TID),
        migrations=lane(MIGRATION_TID),
        busy=dict(busy),
        trainer=sorted(tracks.get((TRAINER_PID, 0), []), key=lambda s: s.start),
    )


def _version(name: str) -> int:
    digits = name.split()[0].lstrip("v")
    return int(digits) if digits.isdigit() else 0


def _color(version: int) -> Any:
    return plt.get_cmap("tab10")(version % 10)


def _busy_curve(
    changes: list[tuple[float, float]], start: float, end: float
) -> tuple[list[float], list[float]]:
    """Step curve of busy slots over [start, end] (value held from each change)."""
    before = [v for t, v in changes if t <= start]
    xs, ys = [start], [before[-1] if before else 0.0]
    for t, v in changes:
        if start < t < end:
            xs.append(t)
            ys.append(v)
    xs.append(end)
    ys.append(ys[-1])
    return xs, ys


def _draw_instance(ax: Any, view: TraceView, i: int, y: float, slots: int) -> set[int]:
    seen = set()
    for span in view.versions.get(i, []):
        v = _version(span.name)
        seen.add(v)
        xs, ys = _busy_curve(view.busy.get(i, []), span.start, span.end)
        tops = [y + LANE * min(1.0, b / slots) for b in ys]
        ax.fill_between(xs, y, tops, step="post", color=_color(v), linewidth=0)
    for span in view.loads.get(i, []):
        ax.broken_barh([(span.start, span.end - span.start)], (y, LANE), facecolor="none",
                       edgecolor="0.3", hatch="////", linewidth=0.5)  # fmt: skip
    ax.axhline(y + LANE, color="0.85", linewidth=0.5)
    return seen


def _draw_trainer(ax: Any, spans: list[Span], y: float) -> set[int]:
    seen = set()
    for span in spans:
        if span.name.startswith("train step"):
            v = _version(span.name.split("(")[-1]) if "(" in span.name else 0
            seen.add(v)
            ax.broken_barh([(span.start, span.end - span.start)], (y, LANE), color=_color(v))
        else:
            ax.broken_barh([(span.start, span.end - span.start)], (y, LANE), color="#f4cccc")
    return seen


def plot_timeline(trace_path: str | Path, out: str | Path, slots: int, title: str = "") -> Path:
    """Instance lanes (busy share, coloured by hosted version) under a trainer lane."""
    view = read_trace(trace_path)
    instances = sorted(view.versions)
    fig, ax = plt.subplots(figsize=(11, 1.0 + 0.45 * (len(instances) + 1)))
    seen: set[int] = set()
    for row, i in enumerate(instances):
        seen |= _draw_instance(ax, view, i, len(instances) - 1 - row, slots)
    seen |= _draw_trainer(ax, view.trainer, len(instances))
    ax.set_yticks([k + LANE / 2 for k in range(len(instances) + 1)])
    ax.set_yticklabels([f"instance {i}" for i in reversed(instances)] + ["trainer"])
    ax.set_xlabel("wall time (s)")
    ax.set_xlim(left=0)
    handles = [Patch(color=_color(v), label=f"v{v}") for v in sorted(seen)[-10:]]
    handles += [Patch(facecolor="none", edgecolor="0.3", hatch="////", label="weight load"),
                Patch(color="#f4cccc", label="trainer waits for rollout")]  # fmt: skip
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.set_title(title or "timeline (lane height: busy slots; colour: hosted version)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)


def plot_throughput(
    runs: dict[str, list[dict[str, Any]]], figures: dict[str, dict], out: str | Path
) -> Path:
    """Left: consumed tokens over wall time per mode. Right: measured tokens/s per mode."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    for k, (mode, rows) in enumerate(runs.items()):
        times = [0.0] + [r["time_s"] for r in rows]
        tokens = [0]
        for r in rows:
            tokens.append(tokens[-1] + r["consumed_tokens"])
        left.plot(times, tokens, drawstyle="steps-post", label=mode, color=_color(k))
    left.set_xlabel("wall time (s)")
    left.set_ylabel("consumed response tokens")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    modes = list(figures)
    values = [figures[m]["consumed_tokens_per_s"] for m in modes]
    bars = right.bar(modes, values, color=[_color(k) for k in range(len(modes))])
    base = figures.get("sync", {}).get("consumed_tokens_per_s") or 0.0
    for bar, value in zip(bars, values, strict=True):
        label = f"{value:,.0f}" + (f"\n{value / base:.2f}x sync" if base else "")
        right.annotate(label, (bar.get_x() + bar.get_width() / 2, value), ha="center",
                       va="bottom", fontsize=8)  # fmt: skip
    right.set_ylabel("consumed tokens/s (measured steps)")
    right.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)
