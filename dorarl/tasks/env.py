"""The multi-turn environment interface, and how a user's class is found (`module:Class`).

An `Env` serves one episode: `reset(prompt)` gives the first observation (the text the
model sees after the task's prompt), then each `step(response)` judges one turn's response
and answers the next observation, a reward and whether the episode is done. Both are
coroutines, so an environment may wait on tools or services without blocking a thread;
the runtime bounds every call by a timeout and an episode by a turn cap. The episode's
reward is the sum of its steps' rewards. Invariant: an environment sees only text; token
ids, versions and KV are the runtime's business.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dorarl.errors import UserInputError

if TYPE_CHECKING:
    from dorarl.tasks.base import Prompt


@dataclass(frozen=True)
class EnvStep:
    """What an environment answers to one turn."""

    observation: str
    reward: float
    done: bool


class Env(ABC):
    """One episode's environment; a new instance per episode."""

    @abstractmethod
    async def reset(self, prompt: Prompt) -> str:
        """The first observation, appended to the prompt before the first turn."""

    @abstractmethod
    async def step(self, response: str) -> EnvStep:
        """Judge a turn's response (decoded up to its stop token)."""


def load_env_class(spec: str, key: str = "task.env") -> type[Env]:
    """`package.module:ClassName` -> the class, checked; one line naming `key` otherwise."""
    module_name, _, class_name = spec.partition(":")
    if not module_name or not class_name:
        raise UserInputError(f"{key}: expected 'module:Class', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserInputError(f"{key}: cannot import module {module_name!r} ({exc})") from None
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type) or not issubclass(cls, Env):
        raise UserInputError(
            f"{key}: {spec!r} is not a subclass of dorarl.tasks.env.Env (reset, step)"
        )
    return cls
