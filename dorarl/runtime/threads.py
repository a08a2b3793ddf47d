"""CPU threads shared out between the actors of one machine, so they do not oversubscribe it.

The trainer computes in bursts on the critical path (a version is published only when its
step ends), engines decode all the time, and the evaluator works now and then. With the
automatic plan the trainer gets every core while it trains: engines split the cores among
themselves and yield to it (a higher niceness), and the evaluator runs one thread at the
lowest priority, so it takes only what nobody else wants.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dorarl.config import ConfigError

# Added to the niceness Ray starts workers at (15 by default, so engines stop at 19: CFS
# weight 15 against the trainer's 36, ~70% of a contended core to the trainer; from 0, 90%)
ENGINE_NICE = 10
EVALUATOR_NICE = 19
START_NICENESS = os.getpriority(os.PRIO_PROCESS, 0)
"""This process's niceness when it first imported this module (before any lowering)."""


@dataclass(frozen=True)
class ThreadPlan:
    engine: int
    trainer: int
    evaluator: int
    engine_nice: int = 0
    evaluator_nice: int = 0


def share_threads(per_actor: int, instances: int, cpus: int | None = None) -> ThreadPlan:
    """`per_actor` > 0: that many threads for every actor, no priorities (explicit setting).
    0: the automatic plan for `cpus` cores (default: this machine's) and `instances` engines."""
    if per_actor < 0:
        raise ConfigError("ray.threads_per_actor: must be >= 0 (0: share the cores out)")
    if per_actor > 0:
        return ThreadPlan(per_actor, per_actor, per_actor)
    cpus = max(1, cpus if cpus is not None else _usable_cpus())
    return ThreadPlan(
        engine=max(1, cpus // max(1, instances)),
        trainer=cpus,
        evaluator=1,
        engine_nice=ENGINE_NICE,
        evaluator_nice=EVALUATOR_NICE,
    )


def _usable_cpus() -> int:
    """Cores this process may run on (a container's or taskset's limit, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def apply_threads(threads: int, nice: int = 0) -> None:
    """Set this process's torch threads and lower its priority by `nice` (never raises it)."""
    torch.set_num_threads(threads)
    lower_priority(nice)


def lower_priority(nice: int) -> None:
    """Lower this process's priority to `nice` above the niceness it started at (0:
    unchanged): every thread already running (Linux niceness is per thread; threads started
    later inherit their creator's), so a thread pool made before this call yields too.
    Measured from the start, not from now, so an actor built again in the same process
    (dorarl.runtime.actor_pool) ends where a new one would; never raises a priority."""
    if nice <= 0:
        return
    try:
        tids = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]  # no /proc: this thread only
    for tid in tids:
        try:
            now = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, max(now, min(19, START_NICENESS + nice)))
        except OSError:  # the thread ended meanwhile, or no niceness on this platform
            pass
