"""`running_sum`: show the work of a running sum (mod 10) over a labelled digit list.

Prompt `a3b1c4d1e5=`, answer `a33b14c48d19e54`: for each item its label, its digit (copied
from the prompt) and the sum so far. Copying first makes each step local work (find the
label, copy its digit, add it to the previous sum) that a ~1M-parameter model learns on a
CPU. The number of items is a rounded lognormal, so correct-answer lengths are
long-tailed (p99/median of about 6 in tokens with the defaults). The reward is exact
match, 1 or 0. Invariants: the prompts are a pure function of (seed, config); the
evaluation set never repeats a training prompt of `min_unique_items` items or more
(shorter lists are too few to keep apart), and neither does `sample_example`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from dorarl.tasks.base import Prompt, Task
from dorarl.tasks.chartok import build_char_tokenizer

LABELS = "abcdefghijklmnopqrstuvwxyz"
SEPARATOR = "="


@dataclass(frozen=True)
class RunningSumConfig:
    median_items: float = 3.0
    sigma: float = 0.85
    max_items: int = 26
    modulus: int = 10
    n_train: int = 10000
    n_eval: int = 500
    min_unique_items: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.max_items <= len(LABELS):
            raise ValueError(f"max_items must be in 1..{len(LABELS)}, got {self.max_items}")
        if not 2 <= self.modulus <= 10:
            raise ValueError(f"modulus must be in 2..10 (one digit per sum), got {self.modulus}")
        if self.median_items < 1 or self.sigma < 0:
            raise ValueError("median_items must be >= 1 and sigma >= 0")


def sample_items(rng: random.Random, cfg: RunningSumConfig) -> list[int]:
    """A digit list whose length is a rounded lognormal clipped to 1..max_items."""
    length = round(rng.lognormvariate(math.log(cfg.median_items), cfg.sigma))
    length = min(max(length, 1), cfg.max_items)
    return [rng.randrange(cfg.modulus) for _ in range(length)]


def format_prompt(items: list[int]) -> str:
    return "".join(f"{label}{d}" for label, d in zip(LABELS, items, strict=False)) + SEPARATOR


def running_answer(items: list[int], modulus: int) -> str:
    total, parts = 0, []
    for label, d in zip(LABELS, items, strict=False):
        total = (total + d) % modulus
        parts.append(f"{label}{d}{total}")
    return "".join(parts)


class RunningSumTask(Task):
    """The built-in task; prompts are built once, on first use."""

    name = "running_sum"

    def __init__(self, seed: int = 0, config: RunningSumConfig | None = None, tokenizer=None):
        self.seed = seed
        self.config = config or RunningSumConfig()
        self.tokenizer = tokenizer if tokenizer is not None else build_char_tokenizer()
        self.stop_token_ids = [self.tokenizer.eos_token_id]
        # Room for a full answer at max_items plus slack, so a wrong answer can still stop.
        self.max_new_tokens = 3 * self.config.max_items + 8
        self._train: list[Prompt] | None = None
        self._eval: list[Prompt] | None = None
        self._eval_texts: set[str] | None = None

    def train_prompts(self) -> list[Prompt]:
        if self._train is None:
            rng = random.Random(f"running_sum/train/{self.seed}")
            self._train = [
                self._prompt(i, sample_items(rng, self.config)) for i in range(self.config.n_train)
            ]
        return self._train

    def eval_prompts(self) -> list[Prompt]:
        if self._eval is None:
            self._eval = self._build_eval()
        return self._eval

    def _build_eval(self) -> list[Prompt]:
        seen = {p.text for p in self.train_prompts()}
        rng = random.Random(f"running_sum/eval/{self.seed}")
        prompts: list[Prompt] = []
        while len(prompts) < self.config.n_eval:
            items = sample_items(rng, self.config)
            text = format_prompt(items)
            if len(items) >= self.config.min_unique_items and text in seen:
                continue
            # Eval ids start after the training ids so the two sets never share an id.
            prompts.append(self._prompt(self.config.n_train + len(prompts), items))
        return prompts

    def _prompt(self, prompt_id: int, items: list[int]) -> Prompt:
        text = format_prompt(items)
        ids = self.tokenizer(text)["input_ids"]
        return Prompt(prompt_id, text, ids, running_answer(items, self.config.modulus))

    def sample_example(self, rng: random.Random, lengths: str = "task") -> tuple[Prompt, list[int]]:
        """A fresh (prompt, correct response ids incl. EOS) for supervised pre-training.

        `lengths`: "task" draws the item count like the prompts; "uniform" draws it uniformly
        from 1..max_items (more long lists: a denser signal for learning the lookup). Never
        a held-out prompt long enough to keep apart, so the evaluation set stays held out for
        a model pre-trained on these.
        """
        held_out = self._held_out_texts()
        while True:
            items = self._draw_items(rng, lengths)
            if len(items) < self.config.min_unique_items or format_prompt(items) not in held_out:
                prompt = self._prompt(-1, items)
                return prompt, self.answer_ids(prompt)

    def _draw_items(self, rng: random.Random, lengths: str) -> list[int]:
        if lengths == "task":
            return sample_items(rng, self.config)
        if lengths == "uniform":
            count = rng.randint(1, self.config.max_items)
            return [rng.randrange(self.config.modulus) for _ in range(count)]
        raise ValueError(f"unknown length distribution {lengths!r}")

    def _held_out_texts(self) -> set[str]:
        if self._eval_texts is None:
            self._eval_texts = {p.text for p in self.eval_prompts()}
        return self._eval_texts

    def answer_ids(self, prompt: Prompt) -> list[int]:
        """The correct response as the model should emit it: answer tokens, then EOS."""
        ids = self.tokenizer(prompt.answer, add_special_tokens=False)["input_ids"]
        return ids + [self.tokenizer.eos_token_id]

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float:
        return 1.0 if self.answer_text(response_ids, prompt) == prompt.answer else 0.0
