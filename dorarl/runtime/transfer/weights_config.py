"""The `weights.*` keys of `dorarl train` and the transport they resolve to (no torch or Ray
here: `dorarl train --help` reads it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dorarl.config import ConfigError

MIB = 1 << 20


@dataclass(kw_only=True)
class WeightsConfig:
    """The `weights.*` keys of `dorarl train`."""

    transport: Literal["auto", "collective", "object_store"] = field(
        default="auto",
        metadata={
            "help": "how weights reach the engines: collective (torch.distributed from the "
            "trainer and peer to peer: gloo on the CPU, NCCL between GPUs, CUDA IPC on one "
            "GPU) | object_store (Ray's) | auto (collective when the trainer and the engines "
            "are on one kind of device, else object_store)"
        },
    )
    bucket_mb: int = field(
        default=256,
        metadata={"help": "collective: MiB per flat bucket sent (one dtype each)", "ge": 1},
    )
    timeout_s: float = field(
        default=300.0,
        metadata={"help": "collective: seconds a transfer or the group's start may take", "gt": 0},
    )

    def resolve(self, engine_device: str, trainer_device: str) -> str:
        """The transport in force: collective needs the trainer and the engines on one kind
        of device (gloo or NCCL for all of them), and `auto` takes it there (the faster on
        both: docs/results.md, `dorarl bench weights`)."""
        kinds = {_kind(engine_device), _kind(trainer_device)}
        if self.transport == "auto":
            return "collective" if len(kinds) == 1 else "object_store"
        if self.transport == "collective" and len(kinds) > 1:
            raise ConfigError(
                f"weights.transport: collective needs the trainer and the engines on one kind "
                f"of device (engine.device={engine_device}, trainer.device={trainer_device})"
            )
        return self.transport

    def spec(
        self, engine_device: str, trainer_device: str, engine_dtype: str, adapters: bool = False
    ) -> TransportSpec:
        """`engine_dtype` as engine.dtype holds it: `auto` is the engines' own choice for
        their device (dorarl.engine.backends), what they hold and thus what is sent.
        `adapters`: a LoRA run whose engines hold adapters, whose versions travel as such."""
        kind = self.resolve(engine_device, trainer_device)
        if engine_dtype == "auto":
            engine_dtype = "bfloat16" if _kind(engine_device) == "cuda" else "float32"
        backend = "nccl" if _kind(engine_device) == "cuda" else "gloo"
        bucket_bytes = self.bucket_mb * MIB
        return TransportSpec(kind, engine_dtype, bucket_bytes, self.timeout_s, backend, adapters)


def _kind(device: str) -> str:
    return "cuda" if device.startswith("cuda") else "cpu"


@dataclass(frozen=True)
class TransportSpec:
    """A resolved transport: which, the engines' dtype, bucket size, timeout, backend, and
    whether versions travel as LoRA adapters (dorarl.runtime.transfer.weight_layout)."""

    kind: str = "object_store"  # "collective" | "object_store"
    dtype: str = "float32"
    bucket_bytes: int = 256 * MIB
    timeout_s: float = 300.0
    backend: str = "gloo"
    adapters: bool = False
