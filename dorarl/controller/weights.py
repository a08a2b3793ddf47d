"""Weight source choice for P2P weight updates (docs/design.md, section 4), a pure function.

A peer that already holds the version serves first (least busy wins); the trainer serves
only when no peer can, and each source serves at most `fanout` loads at once, so a new
version spreads as a tree (1, 2, 4, ... holders) instead of queueing on the trainer.
"""

from __future__ import annotations

from collections.abc import Mapping

from dorarl.controller.commands import TRAINER


def choose_weight_source(
    holders: Mapping[int, int],
    trainer_has_version: bool,
    trainer_busy: int,
    fanout: int = 1,
    p2p: bool = True,
) -> int | None:
    """The source for one load, or None to wait until a source frees up.

    `holders` maps ready peer instances hosting the version to the loads they serve now;
    `trainer_busy` is the loads the trainer serves now. Without p2p the trainer serves all
    (the runtime queues them); a version the trainer no longer holds needs a peer.
    """
    if not p2p:
        return TRAINER if trainer_has_version else _least_busy(holders, 1 << 62)
    peer = _least_busy(holders, fanout)
    if peer is not None:
        return peer
    if trainer_has_version and trainer_busy < fanout:
        return TRAINER
    return None


def _least_busy(holders: Mapping[int, int], fanout: int) -> int | None:
    free = [(busy, peer) for peer, busy in holders.items() if busy < fanout]
    return min(free)[1] if free else None
