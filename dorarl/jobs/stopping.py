"""Stopping a run on request: the first SIGINT or SIGTERM asks the run to stop after the
training step and the requests in flight (checkpoint with the groups not trained on,
summary, resume command); a second one aborts at once.

The runtime polls `StopRequest.requested()`; only the abort raises (KeyboardInterrupt), and
the job turns it into one line and exit code 130, never a traceback.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Signal handlers of one run; use as a context manager around the run (main thread)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as a shell reports a process a signal ended."""
        return 128 + (self.signum or 0)

    def __enter__(self) -> StopRequest:
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt  # the second signal: abort now (Ray is shut down on the way)
        self.signum = signum
        print(
            f"dorarl: {signal.Signals(signum).name}: stopping after the current training step "
            "and the requests in flight (press Ctrl-C again to abort at once)",
            file=sys.stderr,
            flush=True,
        )
