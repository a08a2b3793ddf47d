"""The transport a run's `weights.transport` names, made for the Ray runtime."""

from __future__ import annotations

from dorarl.runtime.transfer.collective import CollectiveWeights
from dorarl.runtime.transfer.weights import ObjectStoreWeights, WeightTransport
from dorarl.runtime.transfer.weights_config import TransportSpec


def make_transport(spec: TransportSpec, window: int) -> WeightTransport:
    """`spec.kind`'s transport keeping versions down to `window` below the newest."""
    if spec.kind == "collective":
        return CollectiveWeights(window, spec)
    return ObjectStoreWeights(window, spec)
