"""The task interface: prompts, a verifiable reward, a held-out set and the tokenizer.

Invariants: `prompt_ids` are the exact ids fed to the engines (the tokenizer's special
prefix included); a response is judged only up to its first stop token, so a reward never
depends on what an engine does after it stops.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Prompt:
    """One question: its id (unique within a task), text, token ids and reference answer."""

    prompt_id: int
    text: str
    prompt_ids: list[int]
    answer: str


class Task(ABC):
    """A verifiable RL task. Subclasses fill the attributes and the three methods."""

    name: str
    tokenizer: PreTrainedTokenizerBase
    stop_token_ids: list[int]
    max_new_tokens: int

    @abstractmethod
    def train_prompts(self) -> list[Prompt]: ...

    @abstractmethod
    def eval_prompts(self) -> list[Prompt]: ...

    @abstractmethod
    def reward(self, prompt: Prompt, response_ids: list[int]) -> float: ...

    def response_text(self, response_ids: list[int]) -> str:
        """The response decoded up to (not including) its first stop token."""
        return self.tokenizer.decode(
            cut_at_stop(response_ids, self.stop_token_ids), skip_special_tokens=True
        )


def cut_at_stop(response_ids: list[int], stop_token_ids: list[int]) -> list[int]:
    stops = set(stop_token_ids)
    for i, token in enumerate(response_ids):
        if token in stops:
            return list(response_ids[:i])
    return list(response_ids)
