"""The GRPO trainer: async clipped objective, versioned weights, safetensors checkpoints.

Importing the package or its configs does not import torch (`dorarl train --help` and the
config layer stay fast); `Trainer`, `load_model` and `group_advantages` load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dorarl.trainer.advantages import group_advantages
    from dorarl.trainer.config import LossConfig, TrainerConfig
    from dorarl.trainer.trainer import Trainer, load_model

_HOMES = {
    "group_advantages": "dorarl.trainer.advantages",
    "LossConfig": "dorarl.trainer.config",
    "TrainerConfig": "dorarl.trainer.config",
    "Trainer": "dorarl.trainer.trainer",
    "load_model": "dorarl.trainer.trainer",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'dorarl.trainer' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)


__all__ = ["LossConfig", "Trainer", "TrainerConfig", "group_advantages", "load_model"]
