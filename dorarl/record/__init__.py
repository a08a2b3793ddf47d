"""What a run measures, the same for every runtime: the recorder, its trace, device pacing.

`Recorder` turns a run's event/command stream into metrics.jsonl, trajectories.jsonl,
summary.json and trace.json (`trace.TraceBuilder`); `pacing` holds the device model that
paced workers follow and the real-compute-against-pace figures they report. Imports
neither torch nor Ray.
"""

from dorarl.record.recorder import OVERHEAD_KINDS, Recorder

__all__ = ["OVERHEAD_KINDS", "Recorder"]
