"""trainer.autocast: the policy's matrix products in bfloat16 on a CPU that computes them
natively (avx512_bf16 or AMX), fp32 weights, AdamW state, output layer and loss."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from dorarl.config import ConfigError

if TYPE_CHECKING:  # the config checks run in `dorarl train --help`, which imports no torch
    import torch

Autocast = Literal["none", "bf16"]
# Without one of these a CPU emulates bfloat16 products, slower than float32 ones.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(cpuinfo: Path = CPUINFO) -> set[str]:
    """The CPU's feature flags (the first processor's; empty where there is no cpuinfo)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def check_autocast(autocast: Autocast, device: str, dtype: str) -> None:
    """ConfigError naming `autocast` where bf16 cannot speed up this trainer."""
    if autocast == "none":
        return
    if device.partition(":")[0] != "cpu":
        raise ConfigError(f"autocast: bf16 is for trainer.device=cpu, not {device}")
    if dtype != "float32":
        raise ConfigError(
            f"autocast: bf16 keeps float32 master weights; trainer.dtype={dtype} has none"
        )
    if not has_bf16(cpu_flags()):
        raise ConfigError(
            "autocast: bf16 needs a CPU with avx512_bf16 or amx_bf16 (this one emulates "
            "bfloat16, slower than float32); use autocast=none"
        )


def has_bf16(flags: set[str]) -> bool:
    """Whether `flags` name native bfloat16 products."""
    return any(flag in flags for flag in BF16_FLAGS)


def autocast_context(
    autocast: Autocast, device: torch.device
) -> contextlib.AbstractContextManager[object]:
    """Where the policy's forward runs: bf16 products (fp32 accumulation) under autocast.

    The output layer opts out (dorarl.trainer.chunked_head), so log-probs, entropies and the
    loss are fp32 from fp32 logits; backward follows each product's forward dtype and the
    gradients reach the fp32 parameters as fp32.
    """
    if autocast == "none":
        return contextlib.nullcontext()
    import torch

    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
