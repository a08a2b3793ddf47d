"""Timeline PNGs of simulated runs: at most `MAX_LANES` instance lanes, so they stay readable.

Reads the recorder's trace.json, keeps the trainer and an evenly spaced subset of the
instances, and draws them with the same lane view as `dorarl bench modes`.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from dorarl.record.trace import TRAINER_PID
from dorarl.report.timeline import plot_timeline
from dorarl.run_layout import RunFolder

MAX_LANES = 64


def lane_subset(pids: set[int], limit: int = MAX_LANES) -> set[int]:
    """Evenly spaced instance pids (at most `limit`), always with the first and the last."""
    ordered = sorted(pids)
    if len(ordered) <= limit:
        return set(ordered)
    step = (len(ordered) - 1) / (limit - 1)
    return {ordered[round(i * step)] for i in range(limit)}


def plot_lanes(trace: Path, out: Path, slots: int, title: str, limit: int = MAX_LANES) -> Path:
    data = json.loads(trace.read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    pids = {e["pid"] for e in events if "pid" in e and e["pid"] != TRAINER_PID}
    keep = lane_subset(pids, limit) | {TRAINER_PID}
    kept = [e for e in events if e.get("pid", TRAINER_PID) in keep]
    shown = f"{len(keep) - 1} of {len(pids)} instances" if len(pids) > limit else ""
    with tempfile.TemporaryDirectory() as tmp:
        path = RunFolder(Path(tmp)).trace  # the kept lanes as a trace of their own
        path.write_text(json.dumps({"traceEvents": kept}))
        return plot_timeline(path, out, slots, title=f"{title} {shown}".strip())
