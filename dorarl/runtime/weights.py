"""How weights travel to an engine: the transport behind every LoadWeights of the Ray runtime.

A transport is told each version the trainer publishes (`publish`, with what the trainer
returned for it) and carries a version to an engine from the trainer or from a peer that
hosts it (`load`: the call whose completion means the engine holds it). The engine side of
the runtime and engine recovery go through it only, so another transport (weights over
torch.distributed, say) replaces this one without touching them.

`ObjectStoreWeights` moves weights as Ray object references: the trainer's result for a
version is kept in the object store while the version can still be hosted (the staleness
window), and a peer's copy is asked of the peer when it is the source. On a cluster the
bytes go actor to actor; the driver only passes references.
"""

from __future__ import annotations

from typing import Any, Protocol

import ray


class WeightTransport(Protocol):
    def publish(self, version: int, weights: Any) -> None:
        """The trainer made `version` (`weights`: what its training call returned for it)."""

    def replace(self, version: int, weights: Any) -> None:
        """A new trainer made `version` again (trainer recovery): its copy serves from now."""

    def has(self, version: int) -> bool:
        """Whether the trainer side can still serve `version`."""

    def load(self, engine: Any, version: int, peer: Any | None) -> ray.ObjectRef:
        """Make `engine` host `version`, from `peer` (an engine actor hosting it) or, with
        None, from the trainer's copy; returns the engine's `load_weights` result."""


class ObjectStoreWeights:
    def __init__(self, window: int) -> None:
        self.window = window  # a version more than this below the newest is dropped
        self._trainer: dict[int, ray.ObjectRef] = {}

    def publish(self, version: int, weights: ray.ObjectRef) -> None:
        self._trainer[version] = weights
        self._trainer.pop(version - self.window - 1, None)

    def replace(self, version: int, weights: ray.ObjectRef) -> None:
        if version in self._trainer:
            self._trainer[version] = weights

    def has(self, version: int) -> bool:
        return version in self._trainer

    def trainer_copy(self, version: int) -> ray.ObjectRef:
        """The object reference of the trainer's `version` (the evaluator loads it too)."""
        return self._trainer[version]

    def load(self, engine: Any, version: int, peer: Any | None) -> ray.ObjectRef:
        weights = self._trainer[version] if peer is None else peer.weights.remote()
        return engine.load_weights.remote(weights, version)
