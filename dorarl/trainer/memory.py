"""Peak memory of a stretch of work: CUDA's allocator peak, or on CPU the process's own peak.

On Linux the RSS high-water mark (VmHWM) is reset by writing 5 to /proc/self/clear_refs, so
each step reports its own peak; where that is not allowed, the lifetime peak (getrusage) is
reported instead and `resettable` says so. The high-water mark also counts shared-memory
pages the process has touched (RssShmem): in a Ray actor, the object store's pages of every
weight set it published (about a model's size per version). Those are the object store's
memory, shared with every reader and counted by Ray, and the step does not touch them, so
the shared pages resident at `start()` are taken off: the figure is the step's own memory.
"""

from __future__ import annotations

import re
import resource
import sys
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
GB = 1e9


class PeakMemory:
    """`start()` before the work, `peak_gb()` after: the highest memory in use in between."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.resettable = self.device.type == "cuda" or _reset_rss_peak()
        self.shared_at_start = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.resettable:
            _reset_rss_peak()
            self.shared_at_start = _status_bytes("RssShmem") or 0

    def peak_gb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / GB
        hwm = _status_bytes("VmHWM") if self.resettable else None
        if hwm is None:
            return _lifetime_peak_bytes() / GB
        return (hwm - self.shared_at_start) / GB


def _reset_rss_peak() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return _status_bytes("VmHWM") is not None


def _status_bytes(field: str) -> int | None:
    """A `kB` field of /proc/self/status in bytes (None off Linux or if absent)."""
    try:
        found = re.search(field + r":\s+(\d+) kB", _STATUS.read_text())
    except OSError:
        return None
    return int(found.group(1)) * 1024 if found else None


def _lifetime_peak_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, kB on Linux
