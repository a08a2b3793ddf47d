"""The code task: JSONL problems with a prompt, a language and tests; a response's final
```python block runs in the sandbox on each test (`dorarl.tasks.code_reward`).

Rows: {"prompt": TEXT, "language": "python", "tests": [...]} (`dorarl.tasks.code_tests`),
any other field kept; with the chat template one solved problem (`DEMONSTRATION`) comes
before the prompt. Invariant: loading checks every row's tests (a bad one raises
`UserInputError` naming its line) and the sandbox (refused where it cannot hold).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from dorarl.errors import UserInputError
from dorarl.tasks.assets import CODE_PROBLEMS
from dorarl.tasks.base import Prompt
from dorarl.tasks.code_reward import CodeRewards
from dorarl.tasks.code_tests import read_tests
from dorarl.tasks.hf_datasets import DataSource
from dorarl.tasks.jsonl import JsonlTask, source_rows
from dorarl.tasks.sandbox import BWRAP, Limits, Sandbox
from dorarl.tasks.user_rewards import RewardInput

CODE_REWARDS = ("tests", "all_tests")
# One worked exchange before the problem, with the chat template: a 135M model imitates a
# dialogue far more readily than it follows the prompt's words (SmolLM2-135M-Instruct asked
# bare prints "Enter a number: " prompts and prose around the answer). Not a shipped problem.
DEMONSTRATION: list[dict[str, str]] = [
    {
        "role": "user",
        "content": "Write a Python program that reads a line of words from standard input and "
        "prints how many of the words are longer than three letters. Read with input() and "
        "print only the answer, with no other text. Give your whole program in one ```python "
        "code block.",
    },
    {
        "role": "assistant",
        "content": "```python\nwords = input().split()\nprint(sum(len(w) > 3 for w in words))\n```",
    },
]


class CodeTask(JsonlTask):
    name = "code"

    def __init__(
        self,
        path: str | Path | None = None,
        reward: str | None = None,
        sandbox: str = BWRAP,
        test_timeout_s: float = 6.0,
        workers: int | None = None,
        demonstration: bool = True,
        **options: Any,
    ):
        if reward not in (None, *CODE_REWARDS):
            raise UserInputError(
                f"task.reward: the code task scores by its tests: {' or '.join(CODE_REWARDS)}"
            )
        limits = Limits(cpu_s=max(1, math.ceil(test_timeout_s)), wall_s=test_timeout_s)
        workers = workers or os.cpu_count() or 1
        self.demonstration = demonstration
        self.user_rewards = CodeRewards(
            Sandbox(sandbox, limits, workers), reward == "all_tests", workers
        )
        super().__init__(path or CODE_PROBLEMS, "exact", format="prompt_answer", **options)

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float:
        given = RewardInput(
            prompt.fields(), self.answer_text(response_ids, prompt), response_ids, prompt.answer
        )
        return self.user_rewards.score([given])[0].reward

    def _before_prompt(self) -> list[dict[str, str]]:
        return DEMONSTRATION if self.demonstration else []

    def _load(self, source: DataSource, first_id: int) -> list[Prompt]:
        prompts: list[Prompt] = []
        for where, row in source_rows(source):
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise UserInputError(f"{where}: expected an object with a 'prompt' text")
            answer = f"passes {len(read_tests(row, where))} tests"
            prompts.append(self._prompt(first_id + len(prompts), row["prompt"], answer, where, row))
        if not prompts:
            raise UserInputError(f"{source.value}: no rows")
        return prompts
