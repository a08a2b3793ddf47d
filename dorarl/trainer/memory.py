"""Peak memory of a stretch of work: CUDA's allocator peak, or on CPU the process's peak RSS.

On Linux the RSS high-water mark (VmHWM) is reset by writing 5 to /proc/self/clear_refs, so
each step reports its own peak; where that is not allowed, the lifetime peak (getrusage) is
reported instead and `resettable` says so.
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

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.resettable:
            _reset_rss_peak()

    def peak_gb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / GB
        hwm = _rss_peak_bytes()
        return (hwm if hwm is not None else _lifetime_peak_bytes()) / GB


def _reset_rss_peak() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return _rss_peak_bytes() is not None


def _rss_peak_bytes() -> int | None:
    try:
        found = re.search(r"VmHWM:\s+(\d+) kB", _STATUS.read_text())
    except OSError:
        return None
    return int(found.group(1)) * 1024 if found else None


def _lifetime_peak_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, kB on Linux
