"""The weight-transfer process group: the trainer (rank 0) and every engine at start-up
(ranks 1..N), formed once and used for every transfer after.

It is a process group of its own (`ProcessGroupGloo` / `ProcessGroupNCCL` over a TCPStore
that rank 0 hosts), not torch.distributed's default group, so a trainer that is rank 0 of
its FSDP group as well keeps both. Transfers are point to point: the sender first sends a
header (version, whether it can serve it, bucket count), then the buckets in order; the
receiver posts the matching receives. Gloo on the CPU, NCCL between GPUs (NCCL makes a
two-rank communicator per pair on first use, cached after). Two members on one GPU (NCCL
refuses two ranks on a device) never send to each other: they hand buckets over as CUDA
IPC handles instead (`share` / `open_shared`), which Ray carries as small objects.
Migrated requests' KV travels over the same group (dorarl.runtime.transfer.kv_transfer), on a tag
of its own.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from dorarl.trainer.rendezvous import bind_collectives_to, joined_store, listening_store

HEADER_OK, HEADER_REFUSED = 1, 0
WEIGHTS_TAG, KV_TAG = 0, 1
"""The pair's two streams: weight buckets, and migrated requests' KV (gloo keeps tags apart;
NCCL has none, and relies on each receiver asking for one transfer at a time)."""


@dataclass(frozen=True)
class GroupAddress:
    """Where the group meets: rank 0's store, the group's size and backend."""

    host: str
    port: int
    world: int
    backend: str  # "gloo" | "nccl"
    timeout_s: float


@dataclass(frozen=True)
class BucketShape:
    """What one bucket of a transfer is: announced with the header, so filler can stand in."""

    numel: int
    dtype: torch.dtype

    @staticmethod
    def of(tensor: torch.Tensor) -> BucketShape:
        return BucketShape(tensor.numel(), tensor.dtype)

    def check(self, bucket: torch.Tensor) -> torch.Tensor:
        if bucket.numel() != self.numel or bucket.dtype != self.dtype:
            raise RuntimeError(
                f"weight group: a bucket of {bucket.numel()} {bucket.dtype} where "
                f"{self.numel} {self.dtype} was announced"
            )
        return bucket


@dataclass(frozen=True)
class Member:
    """What a member reports on joining: its rank and the device its buckets live on
    (`device_key`: node and GPU, equal for two members on one GPU)."""

    rank: int
    device_key: str


def route(src: Member, dst: Member) -> tuple[int, str]:
    """How `dst` receives from `src`: the sender's rank, and "ipc" when both are on one GPU
    (NCCL refuses that pair), else "group"."""
    return src.rank, "ipc" if src.device_key == dst.device_key else "group"


LOOPBACK = "127.0.0.1"


def alive_nodes() -> int:
    """The Ray cluster's live nodes: on one, every group binds loopback."""
    import ray

    return sum(1 for node in ray.nodes() if node.get("Alive"))


def own_host(loopback: bool) -> str:
    """The address this process binds for the group: loopback on one node, else its node's."""
    if loopback:
        return LOOPBACK
    import ray

    return ray.util.get_node_ip_address()


def open_store(host: str, timeout_s: float) -> tuple[dist.TCPStore, int]:
    """Rank 0's store on a free port of `host`, listening there only (returns at once;
    members join later)."""
    return listening_store(host, timeout_s)


def device_key(device: torch.device) -> str:
    """Node and GPU of `device` ("cpu" devices never share buffers)."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    if device.type != "cuda":
        return f"{node}/cpu/{os.getpid()}"  # CPU members never share buffers
    return f"{node}/{torch.cuda.get_device_properties(device).uuid}"


class WeightGroup:
    """This process's membership: point-to-point transfers of bucket lists."""

    def __init__(
        self,
        address: GroupAddress,
        rank: int,
        device: torch.device,
        store: dist.Store | None = None,
    ) -> None:
        self.address, self.rank, self.device = address, rank, device
        timeout = datetime.timedelta(seconds=address.timeout_s)
        if store is None:
            store = joined_store(address.host, address.port, address.timeout_s)
        self._store = store  # rank 0's must outlive the group
        prefixed = dist.PrefixStore("dorarl-weights", store)
        host = own_host(address.host == LOOPBACK)
        self.pg = _process_group(address, rank, host, prefixed, timeout)

    def send(
        self,
        buckets: Iterable[torch.Tensor],
        layout: Sequence[BucketShape],
        version: int,
        dst: int,
        tag: int = WEIGHTS_TAG,
    ) -> None:
        """Header, then the buckets laid out as `layout` to `dst` (`tag`: which stream of
        the pair). `buckets` may be made lazily; if making one fails (or it is not what
        `layout` announced), the rest go as zeros of the announced sizes and the error is
        raised after: the receiver's posted receives complete at once, it learns of the
        failure from this call's result, and the pair stays in step (a receive left waiting
        would only end at the group's timeout, and a gloo timeout closes the pair)."""
        self._header(version, HEADER_OK, len(layout), dst, tag)
        made = iter(buckets)
        failure: Exception | None = None
        for shape in layout:
            bucket = None
            if failure is None:
                try:
                    bucket = shape.check(next(made))
                except Exception as exc:  # sent as filler, raised once the pair is in step
                    failure = exc
            if bucket is None:
                bucket = torch.zeros(shape.numel, dtype=shape.dtype, device=self.device)
            self.pg.send([bucket], dst, tag).wait()
        if failure is not None:
            raise failure

    def refuse(self, version: int, dst: int, tag: int = WEIGHTS_TAG) -> None:
        """Tell `dst`, waiting for `version`, that this member cannot serve it."""
        self._header(version, HEADER_REFUSED, 0, dst, tag)

    def receive(
        self, buckets: list[torch.Tensor], version: int, src: int, tag: int = WEIGHTS_TAG
    ) -> bool:
        """Receive into `buckets` from `src`; False when `src` refused (nothing received).
        A sender that dies mid-transfer closes its connections, which fails the receive
        (at worst after the group's timeout)."""
        header = torch.zeros(3, dtype=torch.int64, device=self.device)
        self.pg.recv([header], src, tag).wait()
        got_version, status, count = header.tolist()
        if status != HEADER_OK:
            return False
        if got_version != version or count != len(buckets):
            raise RuntimeError(
                f"weight group: rank {src} sent {got_version} in {count} buckets, "
                f"rank {self.rank} expected {version} in {len(buckets)} (tag {tag})"
            )
        for bucket in buckets:
            self.pg.recv([bucket], src, tag).wait()
        return True

    def _header(self, version: int, status: int, count: int, dst: int, tag: int) -> None:
        header = torch.tensor([version, status, count], dtype=torch.int64, device=self.device)
        self.pg.send([header], dst, tag).wait()


def _process_group(address: GroupAddress, rank: int, host: str, store: dist.Store, timeout) -> Any:
    if address.backend == "nccl":
        bind_collectives_to(host)  # NCCL's bootstrap sockets
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, address.world, options)
    options = dist.ProcessGroupGloo._Options()
    # every pair connected now, at start-up (gloo's lazy pairs are experimental)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host, lazy_init=False)]
    options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, address.world, options)


# ---- one GPU, two processes: CUDA IPC -------------------------------------------------------
def share(buckets: list[torch.Tensor]) -> list[tuple[Any, tuple]]:
    """CUDA IPC handles of `buckets` (the owner keeps them alive until the reader is done)."""
    torch.cuda.current_stream(buckets[0].device).synchronize()
    return [reduce_tensor(bucket) for bucket in buckets]


def open_shared(handles: list[tuple[Any, tuple]], into: list[torch.Tensor]) -> None:
    """Copy the buckets behind `handles` (another process's, on this GPU) into `into`."""
    for (rebuild, args), target in zip(handles, into, strict=True):
        target.copy_(rebuild(*args))
    torch.cuda.current_stream(into[0].device).synchronize()
