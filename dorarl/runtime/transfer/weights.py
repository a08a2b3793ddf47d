"""How weights travel to an engine: the transport behind every LoadWeights of the Ray runtime.

A transport makes the trainer's training calls publish each version its way (`step`,
`initial`), is told each version the trainer publishes (`publish`, with the handle `step`
gave), and carries a version to an engine from the trainer or from a peer that hosts it
(`load`: the call whose completion means the engine holds it). The engine side of the
runtime and engine recovery go through it only. Two exist: `ObjectStoreWeights` (here)
and `CollectiveWeights` (dorarl.runtime.transfer.collective: torch.distributed), chosen by
`weights.transport`.

Whatever carries them, every load is verified: a version's manifest holds the trainer's
fingerprint of every tensor, computed on its device (dorarl.runtime.transfer.weight_layout), and
the engine refuses a load whose tensors, as received and once copied into its own
weights, do not match the manifest of the copy it loads from: the trainer's, or for a
peer the one that peer loaded (so a replayed version that differs from the original, see
dorarl.runtime.recovery.trainer_recovery, is still checked against the bits the peer holds).

A LoRA run whose engines hold adapters (`TransportSpec.adapters`) publishes and loads each
version as its adapter alone, by the same calls, verified the same way; its version 0 is
the base every engine starts on, so a load of it moves nothing (`host_resident`).

`ObjectStoreWeights` moves weights as Ray object references: the trainer's CPU copies of
a version stay in the object store while the version can still be hosted (the staleness
window), and a peer's copy is asked of the peer when it is the source. On a cluster the
bytes go actor to actor; the driver only passes references.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import ray

from dorarl.data import Group
from dorarl.runtime.transfer.weight_endpoints import WEIGHTS_GROUP, WeightServing
from dorarl.runtime.transfer.weight_layout import BASE_VERSION
from dorarl.runtime.transfer.weights_config import TransportSpec


@dataclass(frozen=True)
class Published:
    """A version as the runtime holds it: its manifest and, through the object store, the
    trainer's CPU copies (None when the trainer serves it over the group)."""

    manifest: ray.ObjectRef
    tensors: ray.ObjectRef | None = None


class WeightTransport(Protocol):
    spec: TransportSpec  # its timeout_s bounds every wait on a load

    def start(self, trainer: Any, engines: Sequence[Any]) -> None:
        """Before the first version: whatever the transport sets up once (a group)."""

    def step(self, trainer: Any, groups: list[Group]) -> tuple[ray.ObjectRef, Any]:
        """Submit a training step to `trainer`: its metrics' reference and the handle of
        the version it makes (for `publish`)."""

    def initial(self, trainer: Any) -> Any:
        """The handle of the version `trainer` holds now (the run's first)."""

    def restart(self, trainer: Any, version: int) -> None:
        """A new trainer restored at `version` (trainer recovery) replaces the dead one."""

    def publish(self, version: int, handle: Any) -> None:
        """The trainer made `version` (`handle`: what `step` or `initial` gave for it)."""

    def replace(self, version: int, handle: Any) -> None:
        """A new trainer made `version` again (trainer recovery): its copy serves from now."""

    def has(self, version: int) -> bool:
        """Whether the trainer side can still serve `version`."""

    def load(self, engine: Any, version: int, peer: Any | None) -> ray.ObjectRef:
        """Make `engine` host `version`, from `peer` (an engine actor hosting it) or, with
        None, from the trainer's copy; returns the engine's load result. With adapters on
        the wire the engine takes `version`'s adapter into a slot (version 0: the base it
        holds, nothing moves) and drops those no request there uses."""

    def trainer_copy(self, version: int) -> ray.ObjectRef:
        """A reference to the trainer's CPU copies of `version` (the evaluator loads it)."""

    def manifest_for(self, version: int, peer: Any | None) -> ray.ObjectRef:
        """The manifest a copy of `version` from `peer` (None: the trainer's) must match."""

    def kv_route(self, src: Any, dst: Any) -> tuple[int, str] | None:
        """How a migration's KV goes from engine `src` to `dst`: the source's rank and
        "group" | "ipc" (dorarl.runtime.transfer.kv_transfer), or None: inside the snapshots,
        through the object store."""


def actor_key(actor: Any) -> str:
    return actor._actor_id.hex()


class ObjectStoreWeights:
    def __init__(self, window: int, spec: TransportSpec | None = None) -> None:
        self.window = window  # a version more than this below the newest is dropped
        spec = spec or TransportSpec()
        self.spec = spec
        # The books keep window + 1 versions; a trainer serving them itself keeps one more,
        # as it can be a step ahead of them (its next version made, not yet heard of).
        self.serving = WeightServing(
            spec.kind, spec.dtype, spec.bucket_bytes, window + 2, adapters=spec.adapters
        )
        self.trainer: Any = None  # the trainer actor now
        self._trainer: dict[int, Published] = {}
        self._first: ray.ObjectRef | None = None  # the run's first manifest: engines start there
        # (engine actor, version) -> the manifest it loaded that version by
        self._loaded: dict[tuple[str, int], ray.ObjectRef] = {}

    # ---- the trainer's side ----------------------------------------------------------------
    def start(self, trainer: Any, engines: Sequence[Any]) -> None:
        self.trainer = trainer

    def step(self, trainer: Any, groups: list[Group]) -> tuple[ray.ObjectRef, Published]:
        self.trainer = trainer
        call = trainer.train_step_and_weights.options(num_returns=3)
        metrics, tensors, manifest = call.remote(groups, self.serving)
        return metrics, Published(manifest, tensors if self.spec.kind == "object_store" else None)

    def initial(self, trainer: Any) -> Published:
        self.trainer = trainer
        tensors, manifest = trainer.publish.options(num_returns=2).remote(self.serving)
        self._first = self._first or manifest
        return Published(manifest, tensors if self.spec.kind == "object_store" else None)

    def restart(self, trainer: Any, version: int) -> None:
        self.trainer = trainer  # the dead trainer's copies are the driver's: they stay

    def publish(self, version: int, handle: Published) -> None:
        self._trainer[version] = handle
        self._trainer.pop(version - self.window - 1, None)
        oldest = version - self.window
        self._loaded = {key: m for key, m in self._loaded.items() if key[1] >= oldest}

    def replace(self, version: int, handle: Published) -> None:
        if version in self._trainer:
            self._trainer[version] = handle

    def has(self, version: int) -> bool:
        return version in self._trainer

    def trainer_copy(self, version: int) -> ray.ObjectRef:
        tensors = self._trainer[version].tensors
        assert tensors is not None
        return tensors

    def kv_route(self, src: Any, dst: Any) -> tuple[int, str] | None:
        return None

    # ---- loads -------------------------------------------------------------------------
    def load(self, engine: Any, version: int, peer: Any | None) -> ray.ObjectRef:
        if self.resident_everywhere(version):
            return engine.host_resident.remote(version)
        manifest = self.loading(engine, version, peer)
        if peer is None:
            weights = self.trainer_copy(version)
        else:
            weights = peer.weights.options(concurrency_group=WEIGHTS_GROUP).remote(version)
        return engine.load_weights.remote(weights, version, manifest)

    def resident_everywhere(self, version: int) -> bool:
        """Whether every engine holds `version` from its start: a LoRA run's base, whose
        engines hold adapters."""
        return self.spec.adapters and version == BASE_VERSION

    def loading(self, engine: Any, version: int, peer: Any | None) -> ray.ObjectRef:
        """The manifest `engine` loads `version` by from `peer` (None: the trainer), noted as
        the one it then serves that version by."""
        manifest = self.manifest_for(version, peer)
        self._loaded[(actor_key(engine), version)] = manifest
        return manifest

    def manifest_for(self, version: int, peer: Any | None) -> ray.ObjectRef:
        """What a copy of `version` must match: the trainer's manifest, or the one `peer`
        loaded (the run's first for a peer still on the weights it started with)."""
        if peer is None:
            return self._trainer[version].manifest
        loaded = self._loaded.get((actor_key(peer), version))
        if loaded is not None:
            return loaded
        assert self._first is not None, "a peer serves before the first version was published"
        return self._first
