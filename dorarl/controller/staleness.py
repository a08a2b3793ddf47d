"""Staleness math: tiny pure functions behind admission control and batch selection.

Notation: `t` is the version the next training step will update (steps started so far),
`out[w]` counts groups of behavior version w that are outstanding (dispatched, not yet
consumed) and `done[w]` those of them already complete. The invariant kept by these rules,
for every published w, is  out(<= w) <= capacity(w) = (w + K - t + 1)^+ x TBS.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import islice


def staleness(train_version: int, behavior_version: int) -> int:
    """s of Eq. 1: the version a step updates minus the version that sampled the data."""
    return train_version - behavior_version


def window(newest: int, k: int) -> range:
    """Versions instances may host: at most K+1 consecutive, ending at the newest."""
    return range(max(0, newest - k), newest + 1)


def capacity(version: int, k: int, t: int, tbs: int) -> int:
    """Groups of version <= `version` that steps t .. version+K can still absorb."""
    return max(0, version + k - t + 1) * tbs


def headroom(out: Mapping[int, int], version: int, newest: int, k: int, t: int, tbs: int) -> int:
    """How many more groups may be dispatched under `version` (AReaL-style admission).

    A new group of version w raises out(<= w') for every w' >= w, so each of those
    prefixes must stay within its capacity.
    """
    room = capacity(newest, k, t, tbs)
    below = sum(n for v, n in out.items() if v < version)
    for w in range(version, newest + 1):
        below += out.get(w, 0)
        room = min(room, capacity(w, k, t, tbs) - below)
    return max(0, room)


def training_need(out: Mapping[int, int], k: int, t: int, tbs: int) -> dict[int, int]:
    """Least number of groups of version <= w that step t must take, per w.

    After the step the trainer is at t+1, and out(<= w) must fit capacity at t+1,
    i.e. (w + K - t) x TBS. For w = t - K this is every remaining group of that version.
    """
    need: dict[int, int] = {}
    below = 0
    for w in sorted(out):
        below += out[w]
        excess = below - capacity(w, k, t + 1, tbs)
        if excess > 0:
            need[w] = excess
    return need


def batch_ready(out: Mapping[int, int], done: Mapping[int, int], k: int, t: int, tbs: int) -> bool:
    """Step t may start: TBS complete groups exist and the oldest-first pick meets every need."""
    if sum(done.values()) < tbs:
        return False
    need = training_need(out, k, t, tbs)
    done_below = 0
    for w in sorted(set(done) | set(need)):
        done_below += done.get(w, 0)
        if done_below < need.get(w, 0):
            return False
    return True


def select_batch(queues: Mapping[int, Sequence[int]], tbs: int) -> list[int]:
    """TBS complete groups, oldest version first, completion order within a version."""
    picked: list[int] = []
    for version in sorted(queues):
        take = min(tbs - len(picked), len(queues[version]))
        picked.extend(islice(queues[version], take))
        if len(picked) == tbs:
            break
    return picked
