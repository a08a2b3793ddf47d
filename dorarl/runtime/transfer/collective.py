"""Weights over torch.distributed: the trainer and every engine in one weight-transfer group
formed at start-up, versions sent as flat buckets point to point (dorarl.runtime.transfer.weight_group).

`start` forms the group once: the trainer (rank 0; with trainer.world_size > 1, rank 0 of
its FSDP group, which keeps both groups) hosts the store, every engine joins as rank
1 + its instance id, and each reports its device so a pair on one GPU hands buckets over
through CUDA IPC instead of NCCL. A version stays in the trainer as buckets on its device
(the newest window + 1 of them); a load is the receiver's call, which asks its source (the
trainer, or a peer for the controller's peer-first tree) to send over the group's `weights`
concurrency group and receives into fresh buckets, verified before they are swapped in.

Migrations between engines use the group too: their KV goes point to point (or through
CUDA IPC) while the snapshots' metadata goes through Ray (dorarl.runtime.transfer.kv_transfer).

Recovery: a replaced actor (engine or trainer) is a new process outside the group, and the
group is not re-formed (that would need every transfer in flight to drain at once). Any
load whose source or destination is outside the group goes through the object store
instead (`export_weights` / `weights` on the source, verified the same way), so a
replacement costs its own loads the slower path, never correctness. The rest of the group
keeps its pairs: a gloo or NCCL pair is independent of a dead third member.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray

from dorarl.runtime.transfer.weight_endpoints import WEIGHTS_GROUP
from dorarl.runtime.transfer.weight_group import GroupAddress, Member, alive_nodes, route
from dorarl.runtime.transfer.weights import ObjectStoreWeights, actor_key
from dorarl.runtime.transfer.weights_config import TransportSpec


class CollectiveWeights(ObjectStoreWeights):
    """ObjectStoreWeights' books (versions, manifests, what each engine loaded), loads over
    the group."""

    def __init__(self, window: int, spec: TransportSpec) -> None:
        super().__init__(window, spec)
        self.members: dict[str, Member] = {}  # actor -> its rank and device, at start-up

    def start(self, trainer: Any, engines: Sequence[Any]) -> None:
        """Form the group: every member joins at once (the joins rendezvous)."""
        self.trainer = trainer
        loopback = alive_nodes() <= 1
        timeout = self.spec.timeout_s
        host, port = ray.get(trainer.open_weight_store.remote(loopback, timeout))
        address = GroupAddress(host, port, 1 + len(engines), self.spec.backend, timeout)
        actors = [trainer, *engines]
        joined = ray.get([a.join_weights.remote(address, rank) for rank, a in enumerate(actors)])
        self.members = {actor_key(a): m for a, m in zip(actors, joined, strict=True)}

    def restart(self, trainer: Any, version: int) -> None:
        """A new trainer at `version`: outside the group, it serves through the object
        store; what the dead one served below `version` is gone (peers serve it), and
        `version` itself is published again from the new one."""
        self.trainer = trainer
        for old in [v for v in self._trainer if v < version]:
            del self._trainer[old]
        if version in self._trainer:
            self._trainer[version] = self.initial(trainer)

    def trainer_copy(self, version: int) -> ray.ObjectRef:
        return self.trainer.export_weights.options(concurrency_group=WEIGHTS_GROUP).remote(version)

    def load(self, engine: Any, version: int, peer: Any | None) -> ray.ObjectRef:
        if self.resident_everywhere(version):
            return engine.host_resident.remote(version)
        source = self.trainer if peer is None else peer
        manifest = self.loading(engine, version, peer)
        found = self._route(source, engine)
        if found is None:  # a replacement, outside the group
            return engine.load_weights.remote(self._copy(version, peer), version, manifest)
        return engine.receive_weights.remote(version, manifest, source, *found)

    def kv_route(self, src: Any, dst: Any) -> tuple[int, str] | None:
        """Migrations between members go over the group (CUDA IPC on one GPU); one with a
        replacement at either end, outside the group, through the object store."""
        return self._route(src, dst)

    def _route(self, src: Any, dst: Any) -> tuple[int, str] | None:
        """The group's route from actor `src` to `dst`; None when either is outside it."""
        s, d = self.members.get(actor_key(src)), self.members.get(actor_key(dst))
        return None if s is None or d is None else route(s, d)

    def _copy(self, version: int, peer: Any | None) -> ray.ObjectRef:
        if peer is None:
            return self.trainer_copy(version)
        return peer.weights.options(concurrency_group=WEIGHTS_GROUP).remote(version)
