"""How long an actor took to come up, measured in the actor: its process until the actor's
constructor ran (Ray's worker start and the imports), then the constructor (the model), and
the CPU seconds its process had used by then (what a quiet machine's start-up is made of)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class ActorStartup:
    process_s: float  # from the process's start to the constructor's first line
    setup_s: float  # the constructor: building or loading the model, the KV pool
    cpu_s: float = 0.0  # the process's CPU seconds (user and system) until the constructor ended


class StartupClock:
    """Started as a constructor's first line; `done()` at its last."""

    def __init__(self) -> None:
        self.began = time.time()
        self.process_s = max(0.0, self.began - psutil.Process().create_time())

    def done(self) -> ActorStartup:
        cpu = psutil.Process().cpu_times()
        return ActorStartup(self.process_s, time.time() - self.began, cpu.user + cpu.system)
