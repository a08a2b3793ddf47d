"""How long an actor took to come up, measured in the actor: its process until the actor's
constructor ran (Ray's worker start and the imports), then the constructor (the model), and
the CPU seconds its process had used by then (what a quiet machine's start-up is made of);
for an idle actor built again for a new run (dorarl.runtime.actor_pool), the rebuild alone."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any

import psutil


@dataclass(frozen=True)
class ActorStartup:
    process_s: float  # from the process's start to the constructor's first line
    setup_s: float  # the constructor: building or loading the model, the KV pool
    cpu_s: float = 0.0  # the process's CPU seconds (user and system) until the constructor ended
    reused: bool = False  # a kept process built again: process_s is 0, cpu_s the rebuild's


class StartupClock:
    """Started as a constructor's first line; `done()` at its last."""

    def __init__(self) -> None:
        self.began = time.time()
        self.process_s = max(0.0, self.began - psutil.Process().create_time())

    def done(self) -> ActorStartup:
        return ActorStartup(self.process_s, time.time() - self.began, process_cpu_s())


def process_cpu_s() -> float:
    cpu = psutil.Process().cpu_times()
    return cpu.user + cpu.system


class Reusable:
    """An actor its driver may keep idle after a finished run and build again for the next
    (dorarl.runtime.actor_pool): `idle` frees what the run left, `rebuild` runs the
    constructor again with the new run's arguments in the same process."""

    _startup: ActorStartup

    def release(self) -> None:
        """Let go of the run's state (model, KV, weight group): the class's own part."""
        raise NotImplementedError

    def idle(self) -> bool:
        """Free the run's state; whether this process can serve another run."""
        self.release()
        gc.collect()
        return True

    def rebuild(self, *args: Any, **kwargs: Any) -> ActorStartup:
        cpu = process_cpu_s()
        self.__init__(*args, **kwargs)  # type: ignore[misc]
        took = self._startup
        self._startup = ActorStartup(0.0, took.setup_s, took.cpu_s - cpu, reused=True)
        return self._startup
