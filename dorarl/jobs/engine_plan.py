"""The run's model checked against the engines before any actor starts: the folder its
weights come from, the version the engines start at, and the fast paths its heads allow.

A run reads the model's config.json here (no weights), so a model the engine does not run,
or an explicit `engine.attention=triton` on a head dim the Triton kernels do not take, is
refused in one line naming the key or file (exit 2) before Ray places anything. Each
engine's memory in its GPU share is checked once the cluster is known
(`dorarl.runtime.engine_budget`).
"""

from __future__ import annotations

from pathlib import Path

from dorarl.engine.backends import refuse_unfit
from dorarl.engine.model_spec import ModelSpec, read_hf_config, sizing_spec, spec_from_hf
from dorarl.errors import UserInputError
from dorarl.jobs.config import TrainConfig
from dorarl.jobs.resume import ResumePoint
from dorarl.runtime.transfer.weight_layout import BASE_VERSION
from dorarl.tasks.assets import shipped_base_model
from dorarl.trainer.lora import base_of, is_adapter_folder, merged_folder


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


def model_spec(folder: str, backend: str = "dorarl") -> tuple[ModelSpec, str]:
    """The model's spec from its config.json, and where it was read; UserInputError for a
    model our engine does not run (the trainer, transformers' own class for it, loads
    anything the engine does), but on backend vllm, whose engines run other families and
    say so as they start, its sizes alone (`sizing_spec`)."""
    if not Path(folder).is_dir():
        raise UserInputError(f"model: no folder {folder}")
    where = str(Path(folder) / "config.json")
    try:
        return spec_from_hf(read_hf_config(folder), where), where
    except UserInputError:
        if backend != "vllm":
            raise
        return sizing_spec(folder), where


def check_engines(config: TrainConfig, spec: ModelSpec, where: str) -> None:
    """Refuse, in one line naming the key, an explicit fast path the model's heads rule out
    (our engine's: vLLM chooses its own)."""
    if config.engine.backend == "vllm":
        return
    refuse_unfit(config.engine, spec.head_dim, spec.num_heads // spec.num_kv_heads, where)
