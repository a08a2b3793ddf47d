"""What a version's weights are on the wire: a manifest of named tensors in flat buckets,
with the sender's fingerprint of every tensor, and the check every receiver makes.

The trainer builds a version's `Manifest` once, on its device (`build_manifest`): tensors
in state-dict order, aliases (tied embeddings) dropped, cast to the engines' dtype (what
they hold, so a peer can serve exactly the bits it received), grouped into buckets of at
most `bucket_bytes` of one dtype each (a larger tensor is a bucket of its own). Every
transport carries the manifest beside the bytes, and every receiver refuses a load whose
tensors do not match it (`Manifest.verify`): one line naming the version, the instance,
the tensor and its bucket.

A LoRA run whose engines hold adapters (`engine.max_versions > 1`) sends a version as its
adapter alone: peft's `lora_A` / `lora_B` tensors by name, laid out, fingerprinted and
checked the same way, the manifest naming the adapter's alpha and rank (`AdapterSpec`).
Version 0 of such a run is the base itself (peft starts every B at zero), which every
engine holds from its start (`BASE_VERSION`): it never travels.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dorarl.runtime.transfer.fingerprint import fingerprints

BASE_VERSION = 0
"""The version a LoRA run's base is: its adapters start with B = 0, so version 0 adds nothing."""


class WeightsRefused(RuntimeError):
    """A received version does not match its sender's manifest; the message names it."""


@dataclass(frozen=True)
class AdapterSpec:
    """What makes a version an adapter on the wire: its scale is alpha / rank."""

    alpha: float
    rank: int


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    bucket: int
    offset: int  # elements into its bucket
    fingerprint: int

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n


@dataclass(frozen=True)
class Bucket:
    dtype: str  # torch dtype name, e.g. "float32"
    numel: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.torch_dtype).element_size()


@dataclass(frozen=True)
class Manifest:
    """A version's tensors, their buckets and the sender's fingerprints (small: sent as is)."""

    version: int
    tensors: tuple[TensorEntry, ...]
    buckets: tuple[Bucket, ...]
    adapter: AdapterSpec | None = None  # None: full weights

    @property
    def what(self) -> str:
        """What the version is on the wire, for messages."""
        return "weights" if self.adapter is None else "adapter"

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def in_bucket(self, index: int) -> Iterator[TensorEntry]:
        return (e for e in self.tensors if e.bucket == index)

    def verify(self, named: dict[str, torch.Tensor], version: int, where: str) -> None:
        """Raise WeightsRefused unless `named` is this manifest's version, tensor for tensor
        (names, shapes, dtypes and fingerprints)."""
        head = f"{self.what} of version {version} refused on {where}"
        if version != self.version:
            raise WeightsRefused(f"{head}: the sender's manifest is of version {self.version}")
        for entry in self.tensors:
            _check_present(named, entry, self.buckets[entry.bucket], head)
        got = fingerprints({e.name: named[e.name] for e in self.tensors})
        for entry in self.tensors:
            if got[entry.name] != entry.fingerprint:
                raise WeightsRefused(
                    f"{head}: tensor {entry.name!r} (bucket {entry.bucket} of "
                    f"{len(self.buckets)}) has fingerprint {got[entry.name] & _U64:#018x}, "
                    f"the sender's is {entry.fingerprint & _U64:#018x}"
                )


_U64 = (1 << 64) - 1


def _check_present(
    named: dict[str, torch.Tensor], entry: TensorEntry, bucket: Bucket, head: str
) -> None:
    where = f"tensor {entry.name!r} (bucket {entry.bucket})"
    if entry.name not in named:
        raise WeightsRefused(f"{head}: {where} is missing")
    tensor = named[entry.name]
    if tuple(tensor.shape) != entry.shape or tensor.dtype != bucket.torch_dtype:
        raise WeightsRefused(
            f"{head}: {where} is {tuple(tensor.shape)} {tensor.dtype}, the sender's is "
            f"{entry.shape} {bucket.torch_dtype}"
        )


def wire_tensors(named: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`named` as sent: aliases of an earlier tensor (tied weights) dropped, floating
    tensors in `dtype`, all contiguous (on their own device)."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    wire: dict[str, torch.Tensor] = {}
    for name, tensor in named.items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        tensor = tensor.detach()
        if tensor.is_floating_point():
            tensor = tensor.to(dtype)
        wire[name] = tensor.contiguous()
    return wire


def build_manifest(
    named: dict[str, torch.Tensor],
    version: int,
    bucket_bytes: int,
    adapter: AdapterSpec | None = None,
) -> Manifest:
    """The manifest of `named` (already `wire_tensors`; with `adapter`, an adapter's
    tensors), fingerprints computed on device."""
    prints = fingerprints(named)
    entries: list[TensorEntry] = []
    buckets: list[Bucket] = []
    for name, tensor in named.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        last = buckets[-1] if buckets else None
        fits = last is not None and last.dtype == dtype
        fits = fits and (last.numel + tensor.numel()) * tensor.element_size() <= bucket_bytes
        if not fits:
            buckets.append(Bucket(dtype, 0))
        offset = buckets[-1].numel
        buckets[-1] = Bucket(dtype, offset + tensor.numel())
        shape = tuple(tensor.shape)
        entries.append(TensorEntry(name, shape, len(buckets) - 1, offset, prints[name]))
    return Manifest(version, tuple(entries), tuple(buckets), adapter)


def flatten(named: dict[str, torch.Tensor], manifest: Manifest, index: int) -> torch.Tensor:
    """Bucket `index` of `manifest` filled from `named`: a new flat tensor on their device
    (a copy, never a view of a live tensor)."""
    dtype = manifest.buckets[index].torch_dtype
    return torch.cat([named[e.name].reshape(-1).to(dtype) for e in manifest.in_bucket(index)])


def allocate(manifest: Manifest, device: torch.device | str) -> list[torch.Tensor]:
    """Empty buckets to receive `manifest` into."""
    return [torch.empty(b.numel, dtype=b.torch_dtype, device=device) for b in manifest.buckets]


def unflatten(buckets: list[torch.Tensor], manifest: Manifest) -> dict[str, torch.Tensor]:
    """The named tensors of received buckets (views into them, no copy)."""
    return {
        e.name: buckets[e.bucket][e.offset : e.offset + e.numel].view(e.shape)
        for e in manifest.tensors
    }
