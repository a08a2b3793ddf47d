"""Idle actors a driver keeps between its runs in a Ray it keeps (a notebook's, a script's, a
test session's): the next run builds its engines, trainer and evaluator again in those warm
processes instead of starting new ones (Ray's worker start and some 4 CPU-seconds of imports
each). Off unless `keep_idle_actors()` turned it on; only CPU actors outside a placement
group are kept, and only those of a run that finished.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import ray

log = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 30.0
"""How long an actor may take to free what its run left before it is killed instead."""
REBUILD_TIMEOUT_S = 300.0
"""How long a kept actor may take to build its part of the next run; past it, or on any
error, it is killed and a new actor started in its place."""
MAX_IDLE = 8
"""Idle actors kept at most (each holds a process with torch and its libraries loaded)."""


@dataclass
class IdlePool:
    """Idle actors by what they were started with (class, Ray options, runtime env), for the
    driver's Ray node they live on."""

    enabled: bool = False
    idle: dict[str, list[Any]] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)  # actor id -> its key, while it works
    node: str | None = None  # the Ray node the idle actors belong to

    def key_of(self, cls: type, options: dict[str, Any], tag: str = "") -> str | None:
        """The key an actor of `cls` started with `options` (and `tag`: what else its
        process keeps, its niceness) is kept under; None while keeping is off or for an
        actor never kept (a placement group, a GPU share)."""
        return pool_key(cls, options, tag) if self.enabled else None

    def take(self, key: str, args: tuple, kwargs: dict) -> Any | None:
        """A kept actor of `key` built again with `args`/`kwargs`, or None where none is
        kept (a kept one that fails to build is killed and the next tried)."""
        self._check_node()
        while self.idle.get(key):
            actor = self.idle[key].pop()
            if _rebuilt(actor, args, kwargs):
                return actor
        return None

    def working(self, actor: Any, key: str) -> None:
        """`actor` works for a run now: it may come back under `key` once the run is done."""
        self.keys[_id(actor)] = key

    def park(self, actors: list[Any]) -> list[Any]:
        """Ask each of `actors` this pool started to go idle and keep those that did (up to
        MAX_IDLE in all); returns the actors not kept, for the caller to kill."""
        if not self.enabled:
            return actors
        keyed = [(a, self.keys.pop(_id(a), None)) for a in actors]
        asked = {a.idle.remote(): (a, key) for a, key in keyed if key is not None}
        ready, _ = ray.wait(list(asked), num_returns=len(asked), timeout=IDLE_TIMEOUT_S)
        kept = set()
        for ref in ready:
            actor, key = asked[ref]
            if self.size() < MAX_IDLE and _went_idle(ref):
                self.idle.setdefault(key, []).append(actor)
                kept.add(_id(actor))
        return [a for a in actors if _id(a) not in kept]

    def size(self) -> int:
        return sum(len(actors) for actors in self.idle.values())

    def drain(self) -> int:
        """Kill every idle actor; returns how many there were."""
        actors = [a for kept in self.idle.values() for a in kept]
        self.idle.clear()
        self.keys.clear()
        for actor in actors if ray.is_initialized() else []:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 -- a handle of a Ray left since: nothing to kill
                continue
        return len(actors)

    def _check_node(self) -> None:
        """Forget actors of a Ray this process has left since (their handles are dead)."""
        node = ray.get_runtime_context().get_node_id()
        if node != self.node:
            self.idle.clear()
            self.keys.clear()
            self.node = node


def pool_key(cls: type, options: dict[str, Any], tag: str = "") -> str | None:
    """What a kept actor must have been started with to stand in for a new one; None for an
    actor that is never kept (a GPU share or a placement group is the run's own)."""
    if options.get("num_gpus") or options.get("scheduling_strategy") is not None:
        return None
    return f"{cls.__module__}.{cls.__qualname__} {sorted(options.items())!r} {tag}"


def stop_actors(actors: list[Any], pool: IdlePool | None = None, keep: bool = False) -> None:
    """Kill `actors`; with `keep` (their run finished), those `pool` started go back to it
    idle instead."""
    left = pool.park(actors) if keep and pool is not None else actors
    for actor in left:
        ray.kill(actor, no_restart=True)


def _id(actor: Any) -> str:
    return actor._actor_id.hex()


def _rebuilt(actor: Any, args: tuple, kwargs: dict) -> bool:
    """Whether `actor` built its part of the new run; if not it is killed."""
    try:
        ray.get(actor.rebuild.remote(*args, **kwargs), timeout=REBUILD_TIMEOUT_S)
        return True
    except Exception as exc:  # noqa: BLE001 -- any failure: a new actor reports its own
        log.info("a kept actor could not be built again (%s); starting a new one", exc)
        ray.kill(actor, no_restart=True)
        return False


def _went_idle(ref: Any) -> bool:
    try:
        return bool(ray.get(ref, timeout=0))
    except ray.exceptions.RayError:  # died meanwhile (a chaos test, the OOM killer)
        return False


POOL = IdlePool()


def keep_idle_actors(on: bool = True) -> None:
    """Keep the actors of this process's finished runs idle for its next runs (on), or stop
    keeping them and kill those kept (off). For a driver that keeps its Ray across runs."""
    POOL.enabled = on
    if not on:
        POOL.drain()


def idle_actors() -> IdlePool:
    """This process's pool of idle actors."""
    return POOL


@contextmanager
def kept_ray(address: str | None = None, host: str = "127.0.0.1") -> Iterator[None]:
    """Runs in a row in one Ray, each run's actors kept idle for the next (a benchmark's runs):
    this process's Ray if it has joined one, else the cluster at `address`, else a local one
    on `host`; a Ray opened here is shut down at the end, and idle actors are killed unless
    the process kept them before."""
    from dorarl.runtime.local_ray import check_cluster_auth, join_ray, start_local_ray

    opened = not ray.is_initialized()
    if opened and address:
        check_cluster_auth(address)
        join_ray(address)
    elif opened:
        start_local_ray(host=host)
    keeping = POOL.enabled
    keep_idle_actors()
    try:
        yield
    finally:
        keep_idle_actors(keeping)
        if opened:
            ray.shutdown()
