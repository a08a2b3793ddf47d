"""The engines checked against the model before any actor starts: the fast paths its heads
allow.

A run reads the model's config.json here (no weights), so a setting that cannot run it is
refused in one line naming the key (exit 2) before Ray places anything: an explicit
`engine.attention=triton` on a head dim the Triton kernels do not take.
"""

from __future__ import annotations

from pathlib import Path

from dorarl.engine.backends import refuse_unfit
from dorarl.engine.model_spec import ModelSpec, read_hf_config, spec_from_hf
from dorarl.jobs.config import TrainConfig
from dorarl.tasks.assets import shipped_base_model


def model_folder(config: TrainConfig) -> str:
    """The folder the run's weights come from: the checkpoint it resumes, the model it
    names, or the shipped base model of its task."""
    point = config.resume_point()
    return str(point.folder if point else (config.model or shipped_base_model(config.task.name)))


def model_spec(folder: str) -> tuple[ModelSpec, str]:
    """The model's spec from its config.json, and where it was read."""
    where = str(Path(folder) / "config.json")
    return spec_from_hf(read_hf_config(folder), where), where


def check_engines(config: TrainConfig, spec: ModelSpec, where: str) -> None:
    """Refuse, in one line naming the key, an explicit fast path the model's heads rule out."""
    refuse_unfit(config.engine, spec.head_dim, spec.num_heads // spec.num_kv_heads, where)
