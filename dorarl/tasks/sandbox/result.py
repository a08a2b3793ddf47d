"""What one sandboxed run gave: its exit, output (bounded) and the cause when it failed."""

from __future__ import annotations

import signal
from dataclasses import dataclass


@dataclass(frozen=True)
class RunResult:
    returncode: int | None  # None: killed by the runner (wall time, output)
    stdout: str
    stderr: str
    wall_s: float
    killed_for: str | None = None  # "wall time" or "output" when the runner killed it

    @property
    def ok(self) -> bool:
        return self.killed_for is None and self.returncode == 0

    def cause(self) -> str | None:
        """Why the run failed, in a few words (None: it exited 0)."""
        if self.killed_for == "wall time":
            return f"timed out after {self.wall_s:.1f} s"
        if self.killed_for == "output":
            return "printed past the output limit"
        if self.returncode is None or self.returncode == 0:
            return None
        if self.returncode < 0:
            return _signal_cause(-self.returncode)
        last = self.stderr.strip().splitlines()[-1:] or [f"exit code {self.returncode}"]
        return last[0][:200]


def _signal_cause(number: int) -> str:
    if number == signal.SIGXCPU:
        return "past the CPU-time limit"
    try:
        return f"killed by {signal.Signals(number).name}"
    except ValueError:
        return f"killed by signal {number}"
