"""The task interface: prompts, a verifiable reward, a held-out set and the tokenizer.

Invariants: `prompt_ids` are the exact ids fed to the engines (the tokenizer's special
prefix included); a response is judged only up to its first stop token, so a reward never
depends on what an engine does after it stops, and only after its reasoning
(`answer_text`), so what a model writes while it reasons never scores.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from transformers import PreTrainedTokenizerBase

from dorarl.tasks.reasoning import Reasoning, reasoning_of

PROMPT_TAIL_TOKENS = 32  # the prompt's last tokens read for a reasoning block it opens


@dataclass(frozen=True)
class Prompt:
    """One question: its id (unique within a task), text, token ids, reference answer and,
    for a data file's, its row (every field, as read)."""

    prompt_id: int
    text: str
    prompt_ids: list[int]
    answer: str
    row: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    def fields(self) -> dict[str, Any]:
        """What a user's reward reads as `row`: the data row, else {"prompt", "answer"}."""
        return self.row if self.row is not None else {"prompt": self.text, "answer": self.answer}


class Task(ABC):
    """A verifiable RL task. Subclasses fill the attributes and the three methods; a run's
    `task.reward=module:function` (`user_rewards`) scores in place of `reward`."""

    name: str
    tokenizer: PreTrainedTokenizerBase
    stop_token_ids: list[int]
    max_new_tokens: int
    user_rewards: Any = None  # a dorarl.tasks.user_rewards.Rewards (that module imports this)

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

    def answer_text(self, response_ids: list[int], prompt: Prompt | None = None) -> str:
        """What a reward reads of a response: `response_text` after its last reasoning
        block (the delimiters the tokenizer declares, `dorarl.tasks.reasoning`); "" when it
        ends inside one, opened by it or by `prompt` (a template that starts the block)."""
        ids = cut_at_stop(response_ids, self.stop_token_ids)
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        tail = self.tokenizer.decode(
            prompt.prompt_ids[-PROMPT_TAIL_TOKENS:] if prompt else [], skip_special_tokens=False
        )
        answer = self.reasoning.answer(text, self.reasoning.leaves_open(tail))
        if answer is None:
            return ""
        if answer == text:
            return self.response_text(response_ids)  # no reasoning: the text as it is
        for special in self.tokenizer.all_special_tokens:  # as response_text drops them
            answer = answer.replace(special, "")
        return answer

    @cached_property
    def reasoning(self) -> Reasoning:
        return reasoning_of(self.tokenizer)


def cut_at_stop(response_ids: list[int], stop_token_ids: list[int]) -> list[int]:
    stops = set(stop_token_ids)
    for i, token in enumerate(response_ids):
        if token in stops:
            return list(response_ids[:i])
    return list(response_ids)
