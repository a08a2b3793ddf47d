"""The actors `dorarl bench weights` moves weights between: a source that publishes versions
as the trainer does and sinks that load them as engines do, through the same endpoints.

They hold named tensors of a model's shape (or of its LoRA adapters) instead of a trainer
and an engine, so a 0.5B-parameter bench fits this machine's memory; every byte still goes through the
runtime's own transports (dorarl.runtime.transfer.weights, dorarl.runtime.transfer.collective) and their
endpoint functions, verified against the sender's manifest on every load.
"""

from __future__ import annotations

from typing import Any

import torch

from dorarl.bench.clock import process_cpu_s
from dorarl.runtime.transfer import weight_endpoints as endpoints
from dorarl.runtime.transfer.weight_endpoints import ServedVersions, WeightServing
from dorarl.runtime.transfer.weight_group import (
    GroupAddress,
    Member,
    WeightGroup,
    device_key,
    open_store,
    own_host,
)
from dorarl.runtime.transfer.weight_layout import AdapterSpec, Manifest, WeightsRefused


def random_weights(shapes: dict[str, tuple[int, ...]], dtype: str, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=generator).to(getattr(torch, dtype))
        for name, shape in shapes.items()
    }


class _Clocked:
    def cpu_s(self) -> float:
        """This process's CPU seconds so far (all its threads)."""
        return process_cpu_s()


class SourceHolder(_Clocked):
    """The trainer's side: versions published as `TrainerWorker` publishes them (with
    `adapter`, as a LoRA trainer whose engines hold adapters: `shapes` are its A and B)."""

    def __init__(
        self,
        shapes: dict[str, tuple[int, ...]],
        dtype: str,
        threads: int,
        adapter: AdapterSpec | None = None,
    ) -> None:
        torch.set_num_threads(threads)
        self.named = random_weights(shapes, dtype, seed=0)
        self.adapter = adapter
        self.version = 0
        self.served = ServedVersions()
        self.group: WeightGroup | None = None
        self._store: Any = None

    def advance(self) -> int:
        """A new version: one tensor changes, so no transfer can reuse the last one's bytes."""
        self.version += 1
        next(iter(self.named.values())).add_(1)
        return self.version

    def publish(self, serving: WeightServing) -> tuple[Any, Manifest]:
        return endpoints.publish(self.named, self.version, serving, self.served, self.adapter)

    def open_weight_store(self, loopback: bool, timeout_s: float) -> tuple[str, int]:
        host = own_host(loopback)
        self._store, port = open_store(host, timeout_s)
        return host, port

    def join_weights(self, address: GroupAddress, rank: int) -> Member:
        self.group = WeightGroup(address, rank, torch.device("cpu"), store=self._store)
        return Member(rank, device_key(torch.device("cpu")))

    def send_weights(self, version: int, manifest: Manifest | None, dst: int) -> None:
        assert self.group is not None
        endpoints.send_served(self.group, self.served, version, manifest, dst, 60.0)

    def export_weights(self, version: int) -> dict[str, torch.Tensor]:
        return endpoints.export_served(self.served, version, 60.0)


class SinkHolder(_Clocked):
    """An engine's side: loads verified as `EngineWorker` verifies them, then held (and
    served to a peer)."""

    def __init__(self, instance_id: int, threads: int) -> None:
        torch.set_num_threads(threads)
        self.instance_id = instance_id
        self.named: dict[str, torch.Tensor] = {}
        self.manifest: Manifest | None = None
        self.version = -1
        self.group: WeightGroup | None = None

    def load_weights(self, named: dict, version: int, manifest: Manifest) -> int:
        manifest.verify(named, version, f"instance {self.instance_id}")
        self.named, self.version, self.manifest = dict(named), version, manifest
        return version

    def join_weights(self, address: GroupAddress, rank: int) -> Member:
        self.group = WeightGroup(address, rank, torch.device("cpu"))
        return Member(rank, device_key(torch.device("cpu")))

    def receive_weights(
        self, version: int, manifest: Manifest, source: Any, source_rank: int, via: str
    ) -> int:
        assert self.group is not None
        named = endpoints.receive(self.group, manifest, source, source_rank, via)
        return self.load_weights(named, version, manifest)

    def send_weights(self, version: int, manifest: Manifest, dst: int) -> None:
        assert self.group is not None
        if self.version != version:
            self.group.refuse(version, dst)
            return
        endpoints.send_hosted(self.group, self.named, manifest, dst)

    def weights(self, version: int | None = None) -> dict[str, torch.Tensor]:
        """The hosted version for a peer through the object store (as `EngineWorker`)."""
        if not self.named:
            raise WeightsRefused(f"instance {self.instance_id} hosts nothing yet")
        return self.named

    def drop(self) -> None:
        """Forget the hosted version (the next load must carry every byte again)."""
        self.named, self.version = {}, -1
