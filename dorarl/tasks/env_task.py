"""`task.env=module:Class`: any task's prompts played as episodes of a user's environment.

The task keeps its prompts, tokenizer, stop tokens and held-out set; each episode's first
turn sees the task's prompt followed by the environment's first observation (a `ChatEnv`'s
first turn is its first messages, rendered with the chat template; the prompt reaches it in
`reset`), and the reward is the environment's (the sum of its steps' rewards), not the task's.
"""

from __future__ import annotations

from typing import Any

from dorarl.tasks.base import Prompt, Task
from dorarl.tasks.env import ChatEnv, Env

DEFAULT_MAX_TURNS = 8
"""Turns of an episode at most where task.max_turns is 0 and the task has no cap of its own
(jsonl, arith; multiturn_sum's is its item count)."""


class EnvTask(Task):
    multi_turn = True

    def __init__(
        self, base: Task, env_class: type[Env] | type[ChatEnv], max_turns: int, timeout_s: float
    ):
        self.base, self.env_class = base, env_class
        self.name = f"{base.name}+env"
        self.tokenizer = base.tokenizer
        self.stop_token_ids = base.stop_token_ids
        self.stop_strings = list(getattr(env_class, "stop_strings", ()))
        self.max_new_tokens = base.max_new_tokens
        self.max_turns, self.env_timeout_s = max_turns, timeout_s

    def train_prompts(self) -> list[Prompt]:
        return self.base.train_prompts()

    def eval_prompts(self) -> list[Prompt]:
        return self.base.eval_prompts()

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float:
        return self.base.reward(prompt, response_ids)  # unused: episodes take the env's

    def make_env(self) -> Env | ChatEnv:
        return self.env_class()

    def episode_prompt_ids(self, prompt: Prompt) -> list[int]:
        return list(prompt.prompt_ids)

    def __getattr__(self, name: str) -> Any:  # e.g. answer_ids of the base task
        base = self.__dict__.get("base")  # absent while unpickling (Ray's workers)
        if base is None:
            raise AttributeError(name)
        return getattr(base, name)
