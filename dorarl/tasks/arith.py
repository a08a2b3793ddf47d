"""`arith`: two-number sums and differences asked in words, through the model's chat template.

"What is 51 plus 29?", "Subtract 17 from 64.": the reward is 1 when the response's final
answer, extracted as the `math` reward does (dorarl.tasks.answers), equals the result.
Invariants: the prompts are a pure function of (seed, config); no held-out problem (its
operation and operands, in any order or phrasing) is ever a training prompt; no answer
equals one of its operands, so restating the question never scores.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from dorarl.errors import UserInputError
from dorarl.tasks.base import Prompt, Task
from dorarl.tasks.held_out import draw_held_out, draw_training
from dorarl.tasks.model_files import context_limit, load_chat_tokenizer, stop_ids
from dorarl.tasks.rewards import math_equivalent

SUM_PHRASINGS = (
    "What is {a} plus {b}?",
    "Add {a} and {b}.",
    "What is the sum of {a} and {b}?",
    "Calculate {a} plus {b}.",
)
DIFFERENCE_PHRASINGS = (
    "What is {a} minus {b}?",
    "Subtract {b} from {a}.",
    "How much is {a} minus {b}?",
    "Take {b} away from {a}.",
)


@dataclass(frozen=True)
class ArithConfig:
    """Operands are drawn uniformly from min_value..max_value; a difference is always the
    larger minus the smaller. The held-out set takes n_eval distinct problems, or a quarter
    of all the problems the range allows when that is fewer."""

    min_value: int = 1
    max_value: int = 99
    n_train: int = 10000
    n_eval: int = 500
    system_prompt: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.min_value < self.max_value:
            raise ValueError(
                f"need 0 <= min_value < max_value, got {self.min_value}..{self.max_value}"
            )
        if self.n_train < 1 or self.n_eval < 1:
            raise ValueError("n_train and n_eval must be >= 1")


@dataclass(frozen=True)
class Problem:
    op: str  # "+" or "-"
    a: int
    b: int

    @property
    def result(self) -> int:
        return self.a + self.b if self.op == "+" else self.a - self.b

    def key(self) -> tuple[str, int, int]:
        """Problems that are the same question whatever the order of a sum's operands."""
        if self.op == "+":
            return ("+", min(self.a, self.b), max(self.a, self.b))
        return ("-", self.a, self.b)


def draw_problem(rng: random.Random, cfg: ArithConfig) -> Problem:
    """A uniform sum or difference whose result is none of its operands."""
    while True:
        op = rng.choice("+-")
        a, b = rng.randint(cfg.min_value, cfg.max_value), rng.randint(cfg.min_value, cfg.max_value)
        if op == "-" and a < b:
            a, b = b, a
        problem = Problem(op, a, b)
        if problem.result not in (a, b):
            return problem


def count_problems(lo: int, hi: int) -> int:
    """Distinct problems in lo..hi (0 <= lo): sums of two nonzero operands, unordered, and
    differences a - b with a >= b >= 1 and a != 2b (whose result would repeat an operand)."""
    first = max(lo, 1)
    nonzero = hi - first + 1
    sums = nonzero * (nonzero + 1) // 2
    differences = sum(hi - b + 1 for b in range(first, hi + 1))
    doubles = max(0, hi // 2 - first + 1)
    return sums + differences - doubles


def question(problem: Problem, rng: random.Random) -> str:
    phrasings = SUM_PHRASINGS if problem.op == "+" else DIFFERENCE_PHRASINGS
    return rng.choice(phrasings).format(a=problem.a, b=problem.b)


class ArithTask(Task):
    """The built-in arithmetic task; every prompt is built and checked on construction."""

    name = "arith"

    def __init__(
        self,
        tokenizer: str | Path | PreTrainedTokenizerBase | None = None,
        seed: int = 0,
        config: ArithConfig | None = None,
        max_new_tokens: int = 64,
        max_model_len: int | None = None,
    ):
        self.seed = seed
        self.config = config or ArithConfig()
        self.tokenizer, model_dir = load_chat_tokenizer(tokenizer, "arith")
        self.stop_token_ids = stop_ids(self.tokenizer, model_dir)
        self.max_new_tokens = max_new_tokens
        self.max_model_len = max_model_len or context_limit(model_dir, self.tokenizer)
        eval_problems = self._draw_eval_problems()
        rng = random.Random(f"arith/train/{seed}")
        train_problems = draw_training(self._draw, rng, self.config.n_train, eval_problems)
        self._train = self._prompts(train_problems, first_id=0, rng=rng)
        eval_rng = random.Random(f"arith/eval-phrasing/{seed}")
        self._eval = self._prompts(eval_problems, first_id=self.config.n_train, rng=eval_rng)

    def train_prompts(self) -> list[Prompt]:
        return self._train

    def eval_prompts(self) -> list[Prompt]:
        return self._eval

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float:
        return math_equivalent(self.answer_text(response_ids, prompt), prompt.answer)

    def _draw_eval_problems(self) -> list[Problem]:
        """Distinct problems, drawn before (and so independent of) the training set."""
        distinct = count_problems(self.config.min_value, self.config.max_value)
        n_eval = min(self.config.n_eval, distinct // 4)
        if n_eval < 1:
            raise UserInputError(
                f"task arith: {self.config.min_value}..{self.config.max_value} allows only "
                f"{distinct} problems, too few to hold some out; widen task.max_value"
            )
        return draw_held_out(self._draw, random.Random(f"arith/eval/{self.seed}"), n_eval)

    def _draw(self, rng: random.Random) -> Problem:
        return draw_problem(rng, self.config)

    def _prompts(self, problems: list[Problem], first_id: int, rng: random.Random) -> list[Prompt]:
        texts = [question(p, rng) for p in problems]
        render = self._renderer()
        # The rendered template already holds its special tokens as text.
        ids = self.tokenizer([render(t) for t in texts], add_special_tokens=False)["input_ids"]
        longest = max(len(i) for i in ids)
        if longest + self.max_new_tokens > self.max_model_len:
            raise UserInputError(
                f"task arith: prompts of up to {longest} tokens with max_new_tokens="
                f"{self.max_new_tokens} exceed the context limit of {self.max_model_len} tokens; "
                "raise engine.max_model_len or lower sampling.max_new_tokens"
            )
        return [
            Prompt(first_id + i, text, list(prompt_ids), str(problem.result))
            for i, (problem, text, prompt_ids) in enumerate(zip(problems, texts, ids, strict=True))
        ]

    def _renderer(self) -> Callable[[str], str]:
        """question -> chat text. The template is rendered once around a marker and the
        question put in its place (a Jinja render per prompt would dominate start-up), after
        checking on one question of every phrasing that this equals a full render."""
        marker = "\x00QUESTION\x00"
        prefix, _, suffix = self._render(marker).partition(marker)
        samples = [p.format(a=12, b=3) for p in SUM_PHRASINGS + DIFFERENCE_PHRASINGS]
        if all(prefix + q + suffix == self._render(q) for q in samples):
            return lambda q: prefix + q + suffix
        return self._render

    def _render(self, text: str) -> str:
        messages = [{"role": "user", "content": text}]
        if self.config.system_prompt:
            messages.insert(0, {"role": "system", "content": self.config.system_prompt})
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
