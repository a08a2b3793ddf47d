"""The lines a run prints while it starts (also off a terminal): Ray up, the actors up with the
times they measured themselves, the first step, the first evaluation; each with the seconds
since the run began, so a slow start shows where it went. At the first step one line breaks
the start-up down by phase and names the slowest (`StartupLines.record()`: the summary's)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psutil
import ray

from dorarl.errors import RunFailed
from dorarl.runtime.workers.startup import ActorStartup

PHASE_NAMES = {
    "imports": "imports",
    "checks": "checks",
    "ray": "Ray",
    "actors": "actors",
    "first_step": "first step",
}


class StartupLines:
    """Says each phase once, through `say` (the progress's console), and names the phase
    in progress through `phase` (a live bar's description). `before`: the phases that ran
    before these lines began (the process's imports, the checks), in seconds."""

    def __init__(
        self,
        say: Callable[[str], None],
        phase: Callable[[str], None],
        before: dict[str, float] | None = None,
    ) -> None:
        self.began = time.monotonic()
        self.say, self.phase = say, phase
        self._mark = self.began
        self.first_step_told = self.first_eval_told = False
        self.phases: dict[str, float] = dict(before or {})
        self.actors: dict[str, dict[str, float]] = {}  # per role: its slowest actor's times
        self.actors_cpu_s = 0.0  # every actor's CPU seconds until it was up

    def elapsed(self) -> float:
        return time.monotonic() - self.began

    def _lap(self) -> float:
        now = time.monotonic()
        lap, self._mark = now - self._mark, now
        return lap

    def line(self, text: str) -> None:
        self.say(f"start {self.elapsed():5.1f}s  {text}")

    def ray_up(self, address: str | None, kept: bool = False) -> None:
        """`kept`: the Ray this process had joined before the run, used as it is."""
        if kept:
            where = "the Ray this process had joined"
        elif address:
            where = f"joined the cluster at {address}"
        else:
            where = "a local cluster"
        self.phases["ray"] = self._lap()
        self.line(f"Ray up in {self.phases['ray']:.1f}s ({where})")
        self.phase("starting the actors")

    def actors_up(self, up: dict[str, list[ActorStartup]]) -> None:
        parts = [_describe(role, times) for role, times in up.items() if times]
        self.phases["actors"] = self._lap()
        self.actors = {role: _slowest(times) for role, times in up.items() if times}
        self.actors_cpu_s = sum(t.cpu_s for times in up.values() for t in times)
        self.line(f"actors up in {self.phases['actors']:.1f}s: " + ", ".join(parts))
        self.phase("waiting for the first step")

    def step(self, row: dict[str, Any]) -> None:
        if self.first_step_told:
            return
        self.first_step_told = True
        self.phases["first_step"] = self._lap()
        self.line(
            f"first step done (v{row['version']} -> v{row['new_version']}, "
            f"{row['step_time_s']:.1f}s of training after {self.phases['first_step']:.1f}s); "
            + breakdown_line(self.record())
        )

    def record(self) -> dict[str, Any]:
        """The start-up by phase, as the summary keeps it: seconds per phase in order, their
        total, the slowest phase, each role's slowest actor (its process before the
        constructor: Ray's worker start and the imports; its model: the constructor), and
        the CPU seconds the driver and the actors had used (their sum over the machine's
        cores bounds a quiet machine's start-up from below)."""
        phases = {k: round(v, 2) for k, v in self.phases.items()}
        slowest = max(phases, key=phases.__getitem__) if phases else None
        total = round(sum(phases.values()), 2)
        return {
            "total_s": total,
            "phases_s": phases,
            "slowest": slowest,
            "actors": self.actors,
            "cpu_s": {"driver": round(_own_cpu_s(), 2), "actors": round(self.actors_cpu_s, 2)},
        }

    def evaluation(self, version: int, result: dict[str, Any], scores: str) -> None:
        if self.first_eval_told:
            return
        self.first_eval_told = True
        took = f", {result['eval_s']:.1f}s" if "eval_s" in result else ""
        n = f", n={int(result['n'])}" if result.get("n") is not None else ""
        self.line(f"first evaluation (v{version}{n}): {scores}{took}")


def breakdown_line(record: dict[str, Any]) -> str:
    """`start-up 31.2s to the first step: imports 4.1s, ..., first step 3.1s; slowest:
    actors (engine process 12.0s)`: the phases in order, the slowest named with, for the
    actors, the part that kept them (a role's process: Ray's worker start and its imports,
    or its model)."""
    phases = record["phases_s"]
    parts = ", ".join(f"{PHASE_NAMES.get(k, k)} {v:.1f}s" for k, v in phases.items())
    slowest = record["slowest"]
    why = PHASE_NAMES.get(slowest, slowest) if slowest else "none"
    if slowest == "actors" and record["actors"]:
        role, part, seconds = max(
            ((role, part, t[key]) for role, t in record["actors"].items()
             for part, key in (("process", "process_s"), ("model", "model_s"))),
            key=lambda item: item[2],
        )  # fmt: skip
        why += f" ({role} {part} {seconds:.1f}s)"
    return f"start-up {record['total_s']:.1f}s to the first step: {parts}; slowest: {why}"


def _slowest(times: list[ActorStartup]) -> dict[str, float]:
    """A role's slowest process and model among its actors."""
    return {
        "process_s": round(max(t.process_s for t in times), 2),
        "model_s": round(max(t.setup_s for t in times), 2),
    }


def _own_cpu_s() -> float:
    cpu = psutil.Process().cpu_times()
    return cpu.user + cpu.system


def since_process_start() -> float:
    """Seconds since this process started: what its interpreter and imports took, read as
    a run begins."""
    return max(0.0, time.time() - psutil.Process().create_time())


def _describe(role: str, times: list[ActorStartup]) -> str:
    """One role's times, a range where its actors differ: 3 engines (process 4.1-4.6s, ...);
    an actor kept idle from an earlier run of this process and built again is `reused`."""
    name = role if len(times) == 1 else f"{len(times)} {role}s"
    process = _span([t.process_s for t in times])
    setup = _span([t.setup_s for t in times])
    reused = sum(t.reused for t in times)  # idle processes of earlier runs, built again
    if reused == len(times):
        return f"{name} (reused, model {setup})"
    kept = f"{reused} reused, " if reused else ""
    return f"{name} ({kept}process {process}, model {setup})"


def _span(values: list[float]) -> str:
    low, high = min(values), max(values)
    return f"{low:.1f}s" if round(low, 1) == round(high, 1) else f"{low:.1f}-{high:.1f}s"


def wait_for_actors(
    actors: dict[str, list[Any]], timeout_s: float
) -> dict[str, list[ActorStartup]]:
    """Each actor's own start-up times, by role, once all are up; a run whose actors are not
    all up within `timeout_s` fails naming those still starting. An actor that died or
    raised while starting is left to the runtime, which reports it as it always does (its
    times are then missing here)."""
    refs = {ref: (role, i) for role, handles in actors.items() for i, h in enumerate(handles)
            for ref in [h.startup.remote()]}  # fmt: skip
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    if pending:
        names = ", ".join(f"{refs[r][0]}{refs[r][1]}" for r in pending)
        raise RunFailed(
            f"actors not up after {timeout_s:.0f}s (ray.startup_timeout_s): {names}; "
            "their logs are under the Ray session folder (/tmp/ray/session_latest/logs)"
        )
    up: dict[str, list[ActorStartup]] = {role: [] for role in actors}
    for ref in ready:
        try:
            up[refs[ref][0]].append(ray.get(ref, timeout=0))
        except ray.exceptions.RayError:
            continue
    return up
