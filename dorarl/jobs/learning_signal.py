"""Warnings for a run that cannot learn: steps whose groups all have zero advantage, and
rewards that stay 0 for every response after the first steps. Each says where to read the
prompts, answers and responses: the run's trajectories.jsonl with record.text=true, else
how to turn that on. A step whose every episode its environment's failure ended stops the
run (`check_episodes`): it would train on reward 0 and the next steps fail alike.

GRPO's advantage is a response's reward minus its group's mean, so a group whose G
responses all got the same reward gives no gradient; a step made only of such groups
cannot change the policy. Each warning is given the first time, then again at most once
every `every` steps while the condition lasts, so a long run is told without being
flooded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dorarl.data import Group
from dorarl.errors import UserInputError

log = logging.getLogger(__name__)

HINT = "record.text=true writes prompts, answers and responses to trajectories.jsonl"


def texts_hint(texts_at: Path | None) -> str:
    """Where to read what the model was asked and answered: `texts_at`, the trajectories
    that hold the texts (record.text=true), or how to write them."""
    if texts_at is None:
        return HINT
    return f"the prompts, answers and responses are in {texts_at}"


@dataclass
class LearningSignal:
    texts_at: Path | None = None  # trajectories.jsonl with the texts (record.text=true)
    every: int = 10  # steps between repeats of one warning
    first_steps: int = 3  # steps after which all-zero rewards are a warning
    steps: int = 0
    zero_advantage_steps: int = 0
    rewarded: bool = False  # some response got a non-zero reward
    warned_at: dict[str, int] = field(default_factory=dict)  # warning kind -> step count

    def observe(self, row: dict[str, Any]) -> list[str]:
        """Take one step's metrics row; return (and log) the warnings it calls for."""
        self.steps += 1
        step = row.get("step", self.steps - 1)
        hint = texts_hint(self.texts_at)
        warnings = []
        if row.get("zero_advantage_groups", 0.0) >= 1.0:
            self.zero_advantage_steps += 1
            warnings += self._due(
                "zero_advantage",
                f"step {step}: every group has zero advantage (all responses to each prompt "
                f"got the same reward), so this step cannot change the policy "
                f"({self.zero_advantage_steps} such steps of {self.steps}); {hint}",
            )
        all_zero = row.get("reward_mean", 0.0) == 0.0 and row.get("reward_std", 0.0) == 0.0
        self.rewarded = self.rewarded or not all_zero
        if not self.rewarded and self.steps >= self.first_steps:
            warnings += self._due(
                "zero_reward",
                f"step {step}: every response of the first {self.steps} steps got reward 0; "
                f"check the task's answers and reward; {hint}",
            )
        for warning in warnings:
            log.warning("%s", warning)
        return warnings

    def _due(self, kind: str, message: str) -> list[str]:
        last = self.warned_at.get(kind)
        if last is not None and self.steps - last < self.every:
            return []
        self.warned_at[kind] = self.steps
        return [message]


class EnvFailed(UserInputError):
    """Every episode of a step ended by its environment's failure; one line, exit 2."""


def check_episodes(step: int, groups: list[Group], key: str = "task.env") -> None:
    """Raise EnvFailed when the environment (`key`: task.env, or task.agent) failed every
    episode the step trained on."""
    episodes = [s for g in groups for s in g.samples if s.turns]
    errors = [s.reward_error for s in episodes if s.reward_error is not None]
    if not episodes or len(errors) < len(episodes):
        return
    raise EnvFailed(
        f"{key}: the environment failed every episode of step {step} ({len(errors)} of "
        f"{len(episodes)}), the first with: {errors[0]}; the run stopped (trajectories.jsonl "
        f"has each episode's error)"
    )
