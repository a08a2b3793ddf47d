"""A bounded pool of daemon threads whose calls each wait at most `timeout_s`.

Invariant: `run_all` returns within about twice `timeout_s` whatever the calls do (hang,
sleep, raise): a call not started within `timeout_s` or running past it comes back as a
`TimeoutError`; its thread, if stuck, is left behind (a daemon: it never holds up the
process's exit) and replaced, up to `max_stuck` such threads.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

MAX_STUCK = 64  # threads left behind in calls that never return, at most
_POLL_S = 0.01


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: Future = field(default_factory=Future)
    submitted: float = field(default_factory=time.monotonic)
    started: float | None = None
    given_up: BaseException | None = None


class BoundedPool:
    def __init__(self, workers: int, timeout_s: float, name: str = "calls") -> None:
        self.workers, self.timeout_s, self.name = workers, timeout_s, name
        self._queue: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0  # alive
        self._stuck = 0  # alive but in a call given up on

    def run_all(self, fns: list[Callable[[], Any]]) -> list[tuple[Any, BaseException | None]]:
        """(result, None) or (None, what it raised or TimeoutError) per call, in order."""
        calls = [_Call(fn) for fn in fns]
        self._grow()
        for call in calls:
            self._queue.put(call)
        pending = list(calls)
        while pending:
            now = time.monotonic()
            pending = [c for c in pending if not c.future.done() and not self._overdue(c, now)]
            if pending:
                time.sleep(_POLL_S)
        return [_outcome(c) for c in calls]

    def _overdue(self, call: _Call, now: float) -> bool:
        """Give up on `call` when it waited or ran past the bound (a stuck thread is replaced)."""
        started = call.started
        if now - (started if started is not None else call.submitted) <= self.timeout_s:
            return False
        with self._lock:
            if call.future.done():
                return True
            if started is None and call.future.cancel():
                why = f"no free {self.name} worker within {self.timeout_s:g} s"
            else:
                why = f"took over {self.timeout_s:g} s"
                self._stuck += 1
            call.given_up = TimeoutError(why)
        self._grow()
        return True

    def _grow(self) -> None:
        with self._lock:
            while self._threads - self._stuck < self.workers and self._stuck < MAX_STUCK:
                self._threads += 1
                threading.Thread(target=self._work, daemon=True, name=self.name).start()

    def _work(self) -> None:
        while True:
            call = self._queue.get()
            future = call.future
            if not future.set_running_or_notify_cancel():
                continue
            call.started = time.monotonic()
            try:
                result, error = call.fn(), None
            except BaseException as exc:  # the caller reads it as the call's failure
                result, error = None, exc
            with self._lock:
                if call.given_up is None:
                    _settle(future, result, error)
                    continue
                self._stuck -= 1  # given up on: this thread was counted stuck
                if self._threads - self._stuck > self.workers:
                    self._threads -= 1
                    return


def _settle(future: Future, result: Any, error: BaseException | None) -> None:
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def _outcome(call: _Call) -> tuple[Any, BaseException | None]:
    if call.given_up is not None:
        return None, call.given_up
    error = call.future.exception()
    return (None, error) if error is not None else (call.future.result(), None)
