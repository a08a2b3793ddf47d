"""Migrated requests' KV over the weight-transfer group, not pickled through Ray's object store.

With `weights.transport=collective` a migration's snapshots travel as Ray objects without
their KV (tokens, versions, seeds, counters: small, a `KVParcel`); the source keeps the KV
tensors under a ticket (`HeldKV`) until the destination's import call asks for them: over
the group point to point on its KV tag (gloo on the CPU, NCCL between GPUs, device to
device), through CUDA IPC when both engines share a GPU, or as a Ray object for a
replacement destination outside the group (`via="store"`). As for weight loads
(dorarl.runtime.transfer.weight_endpoints), the receiver asks the source's one-thread `weights`
concurrency group to send, then posts its receives: a source never waits on a busy
receiver, and a pair's weight and KV transfers never interleave.

Nothing is lost: when the KV cannot come (its source died before or while sending, or holds
the ticket no more), `receive` says so and the destination continues the requests from
their tokens (re-prefill under the same version). A source drops a ticket once it was sent
whole (or taken), so a destination that died mid-transfer is redone from the source's copy.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
from dataclasses import dataclass
from typing import Any

import ray
import torch

from dorarl.engine import RequestSnapshot
from dorarl.runtime.calls import DEATHS
from dorarl.runtime.transfer.weight_endpoints import WEIGHTS_GROUP, sender_death
from dorarl.runtime.transfer.weight_group import (
    KV_TAG,
    BucketShape,
    WeightGroup,
    open_shared,
    share,
)


@dataclass(frozen=True)
class KVParcel:
    """A migration's snapshots without their KV, and what the KV is: one tensor of `shapes`
    (`()`: none, nothing computed yet) per snapshot, in `dtype`, held by the source under
    `ticket`."""

    ticket: int
    snapshots: list[RequestSnapshot]
    shapes: list[tuple[int, ...]]
    dtype: str

    @property
    def kv_shapes(self) -> list[tuple[int, ...]]:
        return [shape for shape in self.shapes if shape]

    def with_kv(self, tensors: list[torch.Tensor]) -> list[RequestSnapshot]:
        """The snapshots with their KV put back (`tensors`: one per snapshot that has KV)."""
        got = [tuple(t.shape) for t in tensors]
        if got != self.kv_shapes:
            raise RuntimeError(f"KV of ticket {self.ticket}: got {got}, the parcel says "
                               f"{self.kv_shapes}")  # fmt: skip
        arrived = iter(tensors)
        return [dataclasses.replace(s, kv=next(arrived) if shape else None)
                for s, shape in zip(self.snapshots, self.shapes, strict=True)]  # fmt: skip


def pack_parcel(snapshots: list[RequestSnapshot], held: HeldKV) -> KVParcel:
    """Take the KV out of `snapshots` (kept in `held` under a new ticket): their parcel."""
    tensors = [s.kv for s in snapshots if s.kv is not None]
    dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else "float32"
    shapes = [() if s.kv is None else tuple(s.kv.shape) for s in snapshots]
    for snap in snapshots:
        snap.kv = None
    return KVParcel(held.hold(tensors), snapshots, shapes, dtype)


class HeldKV:
    """The source's KV of migrations not yet delivered, by ticket (thread-safe: the engine's
    thread adds, the `weights` thread sends). Tickets are random, so a replacement actor
    can never hand out another migration's KV for a ticket of the one it replaced."""

    def __init__(self) -> None:
        self._held: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def hold(self, tensors: list[torch.Tensor]) -> int:
        ticket = secrets.randbits(62)
        with self._lock:
            self._held[ticket] = tensors
        return ticket

    def get(self, ticket: int) -> list[torch.Tensor] | None:
        with self._lock:
            return self._held.get(ticket)

    def take(self, ticket: int) -> list[torch.Tensor] | None:
        with self._lock:
            return self._held.pop(ticket, None)

    def __len__(self) -> int:
        return len(self._held)


# ---- the source's side (on its `weights` thread) -------------------------------------------
def send_held(group: WeightGroup, held: HeldKV, ticket: int, dst: int) -> None:
    """The ticket's KV to rank `dst`, dropped once sent whole; a refusal if it is gone."""
    tensors = held.get(ticket)
    if tensors is None:
        group.refuse(ticket, dst, KV_TAG)
        return
    on_device = (t.to(group.device) for t in tensors)
    group.send(on_device, [BucketShape.of(t) for t in tensors], ticket, dst, KV_TAG)
    held.take(ticket)


def share_held(held: HeldKV, ticket: int) -> list | None:
    """CUDA IPC handles of the ticket's KV (a destination on this GPU); None if gone."""
    tensors = held.get(ticket)
    return None if tensors is None else share(tensors) if tensors else []


def take_held(held: HeldKV, ticket: int) -> list[torch.Tensor] | None:
    """The ticket's KV as CPU tensors, for a destination outside the group (None: gone)."""
    tensors = held.take(ticket)
    return None if tensors is None else [t.to("cpu") for t in tensors]


# ---- the destination's side (in its import call) -------------------------------------------
def receive(
    parcel: KVParcel,
    source: Any,
    source_rank: int,
    via: str,
    device: torch.device,
    group: WeightGroup | None,
) -> list[torch.Tensor] | None:
    """The parcel's KV from `source` (rank `source_rank` of `group`) on `device`: over the
    group, via CUDA IPC (`via="ipc"`) or as a Ray object (`via="store"`). None when it
    cannot come: the source died or no longer holds it."""
    if via == "store":
        return _ask(source.take_kv, parcel.ticket)
    dtype = getattr(torch, parcel.dtype)
    buffers = [torch.empty(shape, dtype=dtype, device=device) for shape in parcel.kv_shapes]
    if via == "ipc":
        handles = _ask(source.share_kv, parcel.ticket)
        if handles is None:
            return None
        if buffers:
            open_shared(handles, buffers)
        _ask(source.release_kv, parcel.ticket)  # copied: the source lets it go
        return buffers
    assert group is not None, "a KV receive over the group by an engine outside it"
    sender = source.send_kv.options(concurrency_group=WEIGHTS_GROUP)
    ref = sender.remote(parcel.ticket, group.rank)
    try:
        served = group.receive(buffers, parcel.ticket, source_rank, KV_TAG)
    except Exception:
        if sender_death(ref) is not None:  # died mid-transfer: the requests re-prefill
            return None
        raise
    ray.get(ref)  # the sender's own error, if any
    return buffers if served else None


def _ask(method: Any, ticket: int) -> Any:
    """`method(ticket)` on the source's `weights` thread; None if the source is gone."""
    try:
        return ray.get(method.options(concurrency_group=WEIGHTS_GROUP).remote(ticket))
    except DEATHS:
        return None
