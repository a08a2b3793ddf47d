"""Runtimes execute the controller's commands; this package holds what they share.

`Recorder` turns a run's event/command stream into metrics.jsonl, trajectories.jsonl,
summary.json and trace.json, the same files for the simulator and the Ray runtime.
"""

from dorarl.runtime.recorder import OVERHEAD_KINDS, Recorder

__all__ = ["OVERHEAD_KINDS", "Recorder"]
