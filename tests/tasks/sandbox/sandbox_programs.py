"""Helpers of the sandbox tests: what the host's processes are, read from /proc."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path


def processes_named(comm: str) -> int:
    """Processes on the machine whose name (/proc/N/comm) is `comm`."""
    count = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                count += (entry / "comm").read_text().strip() == comm
            except OSError:
                continue  # gone meanwhile
    return count


def processes_with(marker: str) -> int:
    """Processes on the machine whose command line holds `marker`."""
    count = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                count += marker.encode() in (entry / "cmdline").read_bytes()
            except OSError:
                continue
    return count


def settled(count: Callable[[], int], want: int = 0, within_s: float = 5.0) -> int:
    """`count()` once it equals `want`, or its last value after `within_s`."""
    deadline = time.monotonic() + within_s
    value = count()
    while value != want and time.monotonic() < deadline:
        time.sleep(0.05)
        value = count()
    return value


class PeakCount:
    """The largest `count()` seen while the `with` block runs (polled every 20 ms)."""

    def __init__(self, count: Callable[[], int]) -> None:
        self.count, self.peak, self._stop = count, 0, threading.Event()

    def __enter__(self) -> PeakCount:
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.count())
            self._stop.wait(0.02)
