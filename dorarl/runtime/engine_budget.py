"""Each engine's memory in its share of a GPU, checked before any actor starts: a share that
cannot hold the weights, the workspace and one max_model_len sequence is refused in one
line naming the key that gives the share (exit 2; `dorarl.engine.memory` sizes it).

The GPU's memory is `ray.gpu_memory_gb`, else what nvidia-smi reports on this machine (no
CUDA context is made); with neither, the engines check their share themselves when they
start (`torch.cuda.mem_get_info`). `dorarl train --print-placement` prints the same budget
per engine.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dorarl.config import ConfigError
from dorarl.engine.config import EngineConfig
from dorarl.engine.memory import DTYPE_BYTES, GB, KVPlan, plan_kv, size
from dorarl.runtime.ray_config import RayConfig

if TYPE_CHECKING:
    from dorarl.engine.model_spec import ModelSpec

NVIDIA_SMI_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class EngineBudget:
    """One engine's memory: its share and where the share comes from, and its KV plan for
    a GPU of known memory (None: unknown here)."""

    actor: str
    share: float
    key: str  # the setting that gives the share
    kv: KVPlan | None
    minimum_bytes: int  # weights + workspace + one max_model_len sequence

    def line(self) -> str:
        if self.kv is not None and not self.kv.explicit and not self.kv.fits:
            return f"  {self.actor}: does not fit: {self.kv.shortfall()} ({self.key})"
        if self.kv is not None:
            return f"  {self.actor}: {self.kv.describe()}"
        return (
            f"  {self.actor}: its share ({self.share:.4g} GPU) must hold "
            f"{size(self.minimum_bytes)} (weights, workspace, one max_model_len sequence); set "
            "ray.gpu_memory_gb for its KV blocks"
        )

    def check(self) -> None:
        if self.kv is not None and not self.kv.explicit and not self.kv.fits:
            raise ConfigError(
                f"{self.key}: {self.actor}'s {self.kv.shortfall()} (a larger share, a smaller "
                "engine.max_model_len, a smaller model, or fewer actors on a GPU)"
            )


def engine_budgets(
    instances: int,
    engine: EngineConfig,
    spec: ModelSpec,
    shares: Mapping[str, float],
    gpu_bytes: int | None,
) -> list[EngineBudget]:
    """Each of the `instances` engines on cuda, its share of a GPU of `gpu_bytes` (None:
    unknown; `shares`: the placement's, by actor) as the engine will size its pool there
    (none when the engines run on the CPU)."""
    if not engine.device.startswith("cuda"):
        return []
    elem = DTYPE_BYTES["bfloat16" if engine.dtype == "auto" else engine.dtype]
    # graphs wherever auto may capture them: the larger workspace, so a plan that fits here
    # fits the engine whichever path it runs
    graphs = engine.cuda_graphs == "on" or (
        engine.cuda_graphs == "auto" and engine.attention in ("auto", "triton")
    )
    budgets = []
    for i in range(instances):
        actor = f"engine{i}"
        share, key = engine.gpu_memory_share, "engine.gpu_memory_share"
        if share is None:
            share, key = min(1.0, shares.get(actor, 1.0)), "ray.engine_gpus"
        kv = plan_kv(spec, engine, elem, graphs, gpu_bytes or 0, share)
        known = kv if gpu_bytes is not None else None
        budgets.append(EngineBudget(actor, share, key, known, kv.minimum_bytes))
    return budgets


def budget_lines(budgets: list[EngineBudget], gpu_bytes: int | None) -> list[str]:
    if not budgets:
        return []
    known = f"a {size(gpu_bytes)} GPU" if gpu_bytes is not None else "a GPU of unknown memory"
    return [f"KV budget per engine on {known}:"] + [b.line() for b in budgets]


def gpu_memory(ray_config: RayConfig) -> int | None:
    """Bytes of each GPU: `ray.gpu_memory_gb`, else this machine's smallest GPU as nvidia-smi
    reports it, else None."""
    if ray_config.gpu_memory_gb is not None:
        return int(ray_config.gpu_memory_gb * GB)
    return local_gpu_memory()


def local_gpu_memory() -> int | None:
    """The smallest GPU's memory on this machine per nvidia-smi (which makes no CUDA
    context, unlike asking torch), or None without one."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    query = [exe, "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    try:
        done = subprocess.run(
            query, capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    mib = [int(word) for word in done.stdout.split() if word.isdigit()]
    return min(mib) * 2**20 if mib else None
