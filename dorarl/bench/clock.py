"""How every bench times its work: wall and CPU seconds, and the machine's load average.

On a CPU shared with other jobs the wall clock also measures their load and the CPU clock
does not, so the benches give both, and the load average either side of a run.
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")
CpuClock = Callable[[], float]
"""CPU seconds so far: this process's, or a sum over the actors a bench runs on."""


def process_cpu_s() -> float:
    """This process's CPU seconds so far, all its threads (an actor reports its own)."""
    return time.process_time()


def children_cpu_s() -> float:
    """CPU seconds of this process's finished children so far (a sandbox's whole namespace
    when it has ended)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def load_average() -> list[float]:
    """The machine's 1, 5 and 15-minute load averages, to two decimals."""
    return [round(x, 2) for x in os.getloadavg()]


@dataclass(frozen=True)
class Took:
    """What one piece of work took."""

    wall_s: float
    cpu_s: float


class Stopwatch:
    """Running from its creation; `took()` reads both clocks since then, as often as asked.

    The CPU clock is read outside the wall interval, so a clock that asks other processes
    (a round trip to the actors) adds nothing to the wall time."""

    def __init__(self, cpu_clock: CpuClock = process_cpu_s) -> None:
        self._cpu_clock = cpu_clock
        self._cpu = cpu_clock()
        self._wall = time.perf_counter()

    def wall_s(self) -> float:
        return time.perf_counter() - self._wall

    def took(self) -> Took:
        wall = self.wall_s()
        return Took(wall, self._cpu_clock() - self._cpu)


def timed(fn: Callable[[], T], cpu_clock: CpuClock = process_cpu_s) -> tuple[T, Took]:
    """`fn()` and what it took."""
    watch = Stopwatch(cpu_clock)
    result = fn()
    return result, watch.took()


@dataclass
class Laps:
    """Repeated timings of one contender, in order."""

    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.wall_s)

    def add(self, took: Took) -> None:
        self.wall_s.append(took.wall_s)
        self.cpu_s.append(took.cpu_s)

    def time(self, fn: Callable[[], T]) -> T:
        """`fn()`, its time added as a lap."""
        result, took = timed(fn)
        self.add(took)
        return result

    def median(self) -> Took:
        return Took(statistics.median(self.wall_s), statistics.median(self.cpu_s))

    def total(self) -> Took:
        return Took(sum(self.wall_s), sum(self.cpu_s))


@dataclass
class LoadWindow:
    """The machine's load average when a run started and when it ended."""

    start: list[float]
    end: list[float] = field(default_factory=list)

    def fields(self) -> dict[str, list[float]]:
        """The keys every bench's JSON gives the load under."""
        return {"load_average_start": self.start, "load_average": self.end}


@contextmanager
def load_window() -> Iterator[LoadWindow]:
    """The load average either side of the block; `end` is filled in when the block ends."""
    window = LoadWindow(load_average())
    try:
        yield window
    finally:
        window.end = load_average()
