"""The named objectives of docs/training.md as `LossConfig` choices, so a bench (or a user's
script) compares GRPO, GSPO, CISPO, Dr. GRPO, RLOO and REINFORCE++ by name."""

from __future__ import annotations

import dataclasses
from typing import Any

from dorarl.config import ConfigError
from dorarl.trainer.config import LossConfig

OBJECTIVES: dict[str, dict[str, Any]] = {
    "grpo": {},
    "gspo": {"ratio": "sequence", "aggregation": "seq_mean", "eps_low": 3e-4, "eps_high": 4e-4},
    "gspo_token": {"ratio": "sequence_token", "aggregation": "seq_mean", "eps_low": 3e-4,
                   "eps_high": 4e-4},
    "cispo": {"kind": "cispo"},
    "dr_grpo": {"aggregation": "seq_sum_norm", "normalize_std": False},
    "rloo": {"advantage": "rloo"},
    "reinforce_pp": {"advantage": "reinforce_pp"},
}  # fmt: skip
"""Each objective's keys over the defaults (GRPO/DAPO: token ratio, clip 0.2/0.28, token
mean); GSPO's clip range is its paper's, far narrower than the token one."""


def check_objectives(names: list[str], key: str) -> None:
    """Refuse an unknown name, naming `key` and the choices."""
    unknown = [n for n in names if n not in OBJECTIVES]
    if unknown:
        raise ConfigError(
            f"{key}: unknown objective {unknown[0]!r}; choose from {list(OBJECTIVES)}"
        )


def objective_loss(name: str, base: LossConfig) -> LossConfig:
    """`base` with objective `name`'s keys set (its other keys, e.g. kl_coef, kept)."""
    check_objectives([name], "objective")
    loss = dataclasses.replace(base, **OBJECTIVES[name])
    loss.validate()
    return loss
