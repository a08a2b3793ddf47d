"""The engines checked against the model before any actor starts: the fast paths its heads
allow, and each engine's KV budget in its share of a GPU.

A run reads the model's config.json here (no weights), so a setting that cannot run it is
refused in one line naming the key (exit 2) before Ray places anything: an explicit
`engine.attention=triton` on a head dim the Triton kernels do not take, or a GPU share that
cannot hold the weights, the workspace and one max_model_len sequence
(`dorarl.engine.memory`). The GPU's memory is `ray.gpu_memory_gb`, else what nvidia-smi
reports on this machine (no CUDA context is made); with neither the engines check their
share themselves when they start (`torch.cuda.mem_get_info`). `dorarl train
--print-placement` prints the same budget per engine.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from dorarl.config import ConfigError
from dorarl.engine.backends import refuse_unfit
from dorarl.engine.memory import DTYPE_BYTES, GB, KVPlan, plan_kv, size
from dorarl.engine.model_spec import ModelSpec, read_hf_config, spec_from_hf
from dorarl.errors import UserInputError
from dorarl.jobs.config import TrainConfig
from dorarl.jobs.resume import ResumePoint
from dorarl.runtime.placement import PlacementPlan
from dorarl.runtime.transfer.weight_layout import BASE_VERSION
from dorarl.tasks.assets import shipped_base_model
from dorarl.trainer.lora import base_of, is_adapter_folder, merged_folder

NVIDIA_SMI_TIMEOUT_S = 10.0


def model_folder(config: TrainConfig, point: ResumePoint | None) -> str:
    """The folder the run's weights come from: the checkpoint it resumes (`point`; a LoRA
    one merged into its base, written once into the checkpoint, or with engines that hold
    adapters the base itself: they get the checkpoint's adapter from the trainer), the model
    it names, or the shipped base model of its task."""
    if point is not None and is_adapter_folder(point.folder):
        if config.adapter_versions:
            return str(base_of(Path(point.folder)))
        return str(merged_folder(Path(point.folder)))
    return str(point.folder if point else (config.model or shipped_base_model(config.task.name)))


def engines_start_at(config: TrainConfig, point: ResumePoint | None) -> int:
    """The version the engines' folder holds: the base (version 0) where they hold adapters,
    else the version the run starts at."""
    if config.adapter_versions:
        return BASE_VERSION
    return point.version if point else 0


def model_spec(folder: str) -> tuple[ModelSpec, str]:
    """The model's spec from its config.json, and where it was read; UserInputError for a
    model the engine does not run (the trainer, transformers' own class for it, loads
    anything the engine does)."""
    if not Path(folder).is_dir():
        raise UserInputError(f"model: no folder {folder}")
    where = str(Path(folder) / "config.json")
    return spec_from_hf(read_hf_config(folder), where), where


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
            f"  {self.actor}: its share ({self.share:.4g} GPU) must hold {size(self.minimum_bytes)} "
            "(weights, workspace, one max_model_len sequence); set ray.gpu_memory_gb for its "
            "KV blocks"
        )

    def check(self) -> None:
        if self.kv is not None and not self.kv.explicit and not self.kv.fits:
            raise ConfigError(
                f"{self.key}: {self.actor}'s {self.kv.shortfall()} (a larger share, a smaller "
                "engine.max_model_len, a smaller model, or fewer actors on a GPU)"
            )


def check_engines(config: TrainConfig, spec: ModelSpec, where: str) -> None:
    """Refuse, in one line naming the key, an explicit fast path the model's heads rule out."""
    refuse_unfit(config.engine, spec.head_dim, spec.num_heads // spec.num_kv_heads, where)


def engine_budgets(
    config: TrainConfig, spec: ModelSpec, plan: PlacementPlan, gpu_bytes: int | None
) -> list[EngineBudget]:
    """Each engine on cuda, its share of a GPU of `gpu_bytes` (None: unknown) as the engine
    will size its pool there (none when the engines run on the CPU)."""
    engine = config.engine
    if not engine.device.startswith("cuda"):
        return []
    elem = DTYPE_BYTES["bfloat16" if engine.dtype == "auto" else engine.dtype]
    # graphs wherever auto may capture them: the larger workspace, so a plan that fits here
    # fits the engine whichever path it runs
    graphs = engine.cuda_graphs == "on" or (
        engine.cuda_graphs == "auto" and engine.attention in ("auto", "triton")
    )
    budgets = []
    for i in range(config.instances):
        actor = f"engine{i}"
        share, key = engine.gpu_memory_share, "engine.gpu_memory_share"
        if share is None:
            share, key = min(1.0, plan.shares.get(actor, 1.0)), "ray.engine_gpus"
        kv = plan_kv(spec, engine, elem, graphs, gpu_bytes or 0, share)
        known = kv if gpu_bytes is not None else None
        budgets.append(EngineBudget(actor, share, key, known, kv.minimum_bytes))
    return budgets


def budget_lines(budgets: list[EngineBudget], gpu_bytes: int | None) -> list[str]:
    if not budgets:
        return []
    known = f"a {size(gpu_bytes)} GPU" if gpu_bytes is not None else "a GPU of unknown memory"
    return [f"KV budget per engine on {known}:"] + [b.line() for b in budgets]


def gpu_memory(config: TrainConfig) -> int | None:
    """Bytes of each GPU: `ray.gpu_memory_gb`, else this machine's smallest GPU as nvidia-smi
    reports it, else None."""
    if config.ray.gpu_memory_gb is not None:
        return int(config.ray.gpu_memory_gb * GB)
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
