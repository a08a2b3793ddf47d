"""`multiturn_sum`: the running sum of `running_sum`, revealed a few items per turn.

The environment shows the first items (`a3b1=`); the model answers their running sum in
the base task's notation (`a33b14`) and stops; the environment checks that partial answer
and shows the next items (`c4d1=`), whose answer continues the sum (`c48d19`), and so on.
A wrong partial answer ends the episode with reward 0; the last one right gives 1. Item
counts are lognormal and each turn reveals 1 to `max_chunk` items, so turn counts are
long-tailed. Invariant: the chunking is a pure function of (seed, prompt id), so an
episode restarted anywhere sees the same observations; `env_latency_s` only delays them.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from dorarl.tasks.base import Prompt
from dorarl.tasks.env import Env, EnvStep
from dorarl.tasks.running_sum import (
    LABELS,
    SEPARATOR,
    RunningSumConfig,
    RunningSumTask,
    running_answer,
)


@dataclass(frozen=True)
class MultiTurnSumConfig:
    median_items: float = 4.0
    sigma: float = 0.8
    max_items: int = 20
    max_chunk: int = 3
    n_train: int = 10000
    n_eval: int = 300
    seed: int = 0
    stop_on_wrong: bool = True  # False (benchmarks): every item is revealed, reward per turn
    # An episode that ends at a wrong answer earns the share of the items it got right
    # (leading ones): all-or-nothing, a group of a long list almost always scores all 0 and
    # teaches nothing. Only a full episode earns 1 (the held-out accuracy).
    partial_credit: bool = True

    def __post_init__(self) -> None:
        if self.max_chunk < 1:
            raise ValueError(f"max_chunk must be >= 1, got {self.max_chunk}")


def chunks(prompt: Prompt, max_chunk: int, seed: int) -> list[list[int]]:
    """The prompt's items (parsed back from its text), cut into the turns' reveals."""
    items = [int(ch) for ch in prompt.text.rstrip(SEPARATOR)[1::2]]
    rng = random.Random(f"multiturn_sum/chunks/{seed}/{prompt.prompt_id}")
    out: list[list[int]] = []
    start = 0
    while start < len(items):
        size = rng.randint(1, max_chunk)
        out.append(items[start : start + size])
        start += size
    return out


def reveal(items: list[int], offset: int) -> str:
    """`c4d1=`: the labelled items starting at label `offset`, then the separator."""
    labels = LABELS[offset : offset + len(items)]
    return "".join(f"{label}{d}" for label, d in zip(labels, items, strict=True)) + SEPARATOR


class MultiTurnSumEnv(Env):
    """The built-in environment: reveal, check, reveal; optional simulated tool latency."""

    def __init__(
        self,
        max_chunk: int = 3,
        seed: int = 0,
        latency_s: float = 0.0,
        stop_on_wrong: bool = True,
        partial_credit: bool = False,
    ) -> None:
        self.max_chunk, self.seed, self.latency_s = max_chunk, seed, latency_s
        self.stop_on_wrong, self.partial_credit = stop_on_wrong, partial_credit
        self._items: list[int] = []
        self._chunks: list[list[int]] = []
        self._turn = 0

    async def reset(self, prompt: Prompt) -> str:
        self._chunks = chunks(prompt, self.max_chunk, self.seed)
        self._items = [d for c in self._chunks for d in c]
        self._turn = 0
        return self._observation(0)

    def _observation(self, turn: int) -> str:
        return reveal(self._chunks[turn], sum(len(c) for c in self._chunks[:turn]))

    async def step(self, response: str) -> EnvStep:
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        offset = sum(len(c) for c in self._chunks[: self._turn])
        chunk = self._chunks[self._turn]
        want = running_answer(self._items, 10)[3 * offset : 3 * (offset + len(chunk))]
        self._turn += 1
        if not self.stop_on_wrong:  # every turn is played: the share of right turns
            last = self._turn == len(self._chunks)
            reward = (response == want) / len(self._chunks)
            return EnvStep("" if last else self._observation(self._turn), reward, last)
        if response != want:
            return EnvStep("", self._credit(offset, response, want), True)
        if self._turn == len(self._chunks):
            return EnvStep("", 1.0, True)
        return EnvStep(self._observation(self._turn), 0.0, False)

    def _credit(self, offset: int, response: str, want: str) -> float:
        """A wrong answer's reward: with partial credit the share of the list's items right
        before the first wrong one (this turn's leading items and the earlier turns'), in
        one division, so only a full episode reaches 1."""
        if not self.partial_credit:
            return 0.0
        right = 0
        while (
            right < len(want) // 3
            and response[3 * right : 3 * right + 3] == want[3 * right : 3 * right + 3]
        ):
            right += 1
        return (offset + right) / len(self._items)


class MultiTurnSumTask(RunningSumTask):
    """Prompts of `running_sum` (their items); the environment does the talking."""

    name = "multiturn_sum"
    multi_turn = True

    def __init__(
        self,
        config: MultiTurnSumConfig | None = None,
        tokenizer=None,
        latency_s: float = 0.0,
        timeout_s: float = 30.0,
    ):
        self.mt = config or MultiTurnSumConfig()
        base = RunningSumConfig(
            median_items=self.mt.median_items,
            sigma=self.mt.sigma,
            max_items=self.mt.max_items,
            n_train=self.mt.n_train,
            n_eval=self.mt.n_eval,
        )
        super().__init__(seed=self.mt.seed, config=base, tokenizer=tokenizer)
        self.latency_s = latency_s
        self.env_timeout_s = timeout_s
        self.max_new_tokens = 3 * self.mt.max_chunk + 6  # per turn
        self.max_turns = self.mt.max_items
        self.bos_ids = self.tokenizer("")["input_ids"]

    def make_env(self) -> MultiTurnSumEnv:
        mt = self.mt
        return MultiTurnSumEnv(
            mt.max_chunk, mt.seed, self.latency_s, mt.stop_on_wrong, mt.partial_credit
        )

    def episode_prompt_ids(self, prompt: Prompt) -> list[int]:
        """What precedes the first observation: the tokenizer's prefix only."""
        return list(self.bos_ids)
