"""The GRPO trainer: async clipped objective, versioned weights, safetensors checkpoints."""

from dorarl.trainer.advantages import group_advantages
from dorarl.trainer.config import LossConfig, TrainerConfig
from dorarl.trainer.trainer import Trainer, load_model

__all__ = ["LossConfig", "Trainer", "TrainerConfig", "group_advantages", "load_model"]
