"""Both ends of a weight transfer inside the actors: the trainer serving its versions, an
engine receiving one (and serving the one it hosts to a peer).

`WeightServing` says how the trainer publishes (the runtime sends it with each call):
with the object store, a version leaves as CPU copies beside its manifest; with the
collective transport it stays in the trainer as flat buckets on its device
(`ServedVersions`, the newest `window` versions) until receivers ask for it. Sends run on
the actors' `weights` concurrency group (`WEIGHTS_GROUP`), beside training or decoding, and
only when a receiver asks: the receiver's load call asks its source to send, then posts
its receives, so a source never waits on a receiver that is busy (no cycle of waits).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import ray
import torch

from dorarl.runtime.calls import DEATHS
from dorarl.runtime.transfer.weight_group import BucketShape, WeightGroup, open_shared, share
from dorarl.runtime.transfer.weight_layout import (
    AdapterSpec,
    Manifest,
    WeightsRefused,
    allocate,
    build_manifest,
    flatten,
    unflatten,
    wire_tensors,
)

WEIGHTS_GROUP = "weights"
"""The actors' concurrency group for weight sends (one thread): the default group keeps
running the actor's calls in order, one at a time."""

SENDER_DEATH_WAIT_S = 30.0  # how long a broken receive waits to learn whether its sender died
MADE_WAIT_S = 600.0
"""How long a version asked of the trainer before it is made is waited for: a replacement
trainer replaying its lost steps is asked for them before it made (or published) any."""


@dataclass(frozen=True)
class WeightServing:
    """How the trainer publishes its versions (the transport's settings)."""

    transport: str  # "collective" | "object_store"
    dtype: str  # the engines' dtype: what they hold, so a peer serves the bits it received
    bucket_bytes: int
    window: int  # versions the trainer keeps serving, newest first
    wait_s: float = MADE_WAIT_S
    adapters: bool = False  # a LoRA trainer publishes its adapters alone (weight_layout)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


class ServedVersions:
    """The trainer's copies of the versions it serves over the group (thread-safe: training
    adds versions while the weights thread sends them)."""

    def __init__(self) -> None:
        self._versions: dict[int, tuple[Manifest, list[torch.Tensor]]] = {}
        self._changed = threading.Condition()

    def add(self, manifest: Manifest, buckets: list[torch.Tensor], window: int) -> None:
        with self._changed:
            self._versions[manifest.version] = (manifest, buckets)
            for old in [v for v in self._versions if v <= manifest.version - window]:
                del self._versions[old]
            self._changed.notify_all()

    def get(self, version: int, wait_s: float) -> tuple[Manifest, list[torch.Tensor]] | None:
        """Version `version`, waiting up to `wait_s` for it to be made (None: not served)."""
        with self._changed:
            self._changed.wait_for(lambda: self._made(version), timeout=wait_s)
            return self._versions.get(version)

    def _made(self, version: int) -> bool:
        return version in self._versions or any(v > version for v in self._versions)


def publish(
    named: dict[str, torch.Tensor],
    version: int,
    serving: WeightServing,
    served: ServedVersions,
    adapter: AdapterSpec | None = None,
) -> tuple[dict[str, torch.Tensor] | None, Manifest]:
    """The trainer's `version` (`named` on its device: full weights, or with `adapter` an
    adapter's tensors): its manifest, and the CPU copies the object store carries (None for
    the collective transport, which keeps buckets here)."""
    wire = wire_tensors(named, serving.torch_dtype)
    manifest = build_manifest(wire, version, serving.bucket_bytes, adapter)
    if serving.transport == "collective":
        buckets = [flatten(wire, manifest, i) for i in range(len(manifest.buckets))]
        served.add(manifest, buckets, serving.window)
        return None, manifest
    return {name: t.to("cpu", copy=True) for name, t in wire.items()}, manifest


def send_served(
    group: WeightGroup,
    served: ServedVersions,
    version: int,
    expected: Manifest | None,
    dst: int,
    wait_s: float,
) -> None:
    """The trainer's send of `version` to rank `dst`, or its refusal: when it does not
    serve it, or serves it in other buckets than the receiver's `expected` allocates (a
    receiver that posted other receives would leave the pair out of step)."""
    found = served.get(version, wait_s)
    if found is None or (expected is not None and found[0].buckets != expected.buckets):
        group.refuse(version, dst)
        return
    manifest, buckets = found
    group.send(buckets, layout(manifest), version, dst)


def export_served(served: ServedVersions, version: int, wait_s: float) -> dict[str, torch.Tensor]:
    """CPU copies of a served version (for a receiver outside the group, or the evaluator)."""
    found = served.get(version, wait_s)
    if found is None:
        raise WeightsRefused(f"the trainer no longer serves version {version}")
    manifest, buckets = found
    return {n: t.to("cpu", copy=True) for n, t in unflatten(buckets, manifest).items()}


def share_served(served: ServedVersions, version: int, wait_s: float) -> list | None:
    """CUDA IPC handles of a served version's buckets (None: not served)."""
    found = served.get(version, wait_s)
    return None if found is None else share(found[1])


def send_hosted(
    group: WeightGroup, named: dict[str, torch.Tensor], manifest: Manifest, dst: int
) -> None:
    """A peer's send of the weights it hosts, laid out as `manifest`, one bucket at a time;
    a refusal, then an error naming them, if it hosts no tensor of some of `manifest`'s names."""
    missing = [e.name for e in manifest.tensors if e.name not in named]
    if missing:
        group.refuse(manifest.version, dst)
        raise WeightsRefused(
            f"version {manifest.version} as hosted here has no {', '.join(missing[:3])}"
            f"{' ...' if len(missing) > 3 else ''} ({len(missing)} of the manifest's "
            f"{len(manifest.tensors)} tensors)"
        )
    count = len(manifest.buckets)
    buckets = (flatten(named, manifest, i) for i in range(count))
    group.send(buckets, layout(manifest), manifest.version, dst)


def layout(manifest: Manifest) -> list[BucketShape]:
    """The buckets a transfer of `manifest` announces."""
    return [BucketShape(b.numel, b.torch_dtype) for b in manifest.buckets]


def receive(
    group: WeightGroup,
    manifest: Manifest,
    source: Any,
    source_rank: int,
    via: str,
) -> dict[str, torch.Tensor]:
    """`manifest`'s version from `source` (an actor of the group, rank `source_rank`):
    over the group, or through CUDA IPC (`via="ipc"`, the source on this GPU)."""
    buckets = allocate(manifest, group.device)
    version = manifest.version
    sender = source.__getattr__("share_weights" if via == "ipc" else "send_weights")
    ref = sender.options(concurrency_group=WEIGHTS_GROUP).remote(version, manifest, group.rank)
    if via == "ipc":
        handles = ray.get(ref)
        if handles is None:
            raise WeightsRefused(f"rank {source_rank} does not serve version {version}")
        open_shared(handles, buckets)
        source.release_shared.options(concurrency_group=WEIGHTS_GROUP).remote(version)
        return unflatten(buckets, manifest)
    try:
        served = group.receive(buckets, version, source_rank)
    except Exception as broken:
        death = sender_death(ref)
        if death is not None:  # a sender that died mid-transfer is a death, not an error here
            raise death from broken
        raise
    ray.get(ref)  # the sender's own error, if any
    if not served:
        raise WeightsRefused(f"rank {source_rank} does not serve version {version}")
    return unflatten(buckets, manifest)


def sender_death(ref: ray.ObjectRef) -> Exception | None:
    """After a broken receive: the death of the sender whose send call is `ref`, or None
    (it lives, or failed otherwise: then the receive's own error is the one to raise)."""
    try:
        ray.get(ref, timeout=SENDER_DEATH_WAIT_S)
    except DEATHS as death:
        return death
    except Exception:
        return None
    return None
