"""A task from JSON-lines files: one `{"prompt": str, "answer": str}` object per line.

Invariants: loading either returns well-formed prompts that fit the context or raises a
`UserInputError` naming `file:line` (empty prompts and answers included); blank lines
are skipped and extra fields ignored.
The held-out set is `eval_path` if given, else a seeded `eval_fraction` of the rows.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from dorarl.errors import UserInputError
from dorarl.tasks.base import Prompt, Task
from dorarl.tasks.model_files import context_limit, load_tokenizer, stop_ids
from dorarl.tasks.rewards import get_reward


class JsonlTask(Task):
    name = "jsonl"

    def __init__(
        self,
        path: str | Path,
        reward: str = "exact",
        tokenizer: str | Path | PreTrainedTokenizerBase | None = None,
        eval_path: str | Path | None = None,
        eval_fraction: float = 0.1,
        seed: int = 0,
        max_new_tokens: int = 256,
        max_model_len: int | None = None,
        chat_template: bool = False,
    ):
        try:
            self.reward_fn = get_reward(reward)
        except ValueError as exc:
            raise UserInputError(f"task reward: {exc}") from None
        self.tokenizer, model_dir = load_tokenizer(tokenizer)
        self.stop_token_ids = stop_ids(self.tokenizer, model_dir)
        self.max_new_tokens = max_new_tokens
        self.max_model_len = max_model_len or context_limit(model_dir, self.tokenizer)
        if chat_template and not getattr(self.tokenizer, "chat_template", None):
            model = model_dir if model_dir is not None else "the given tokenizer"
            raise UserInputError(f"task.chat_template=true: {model} has no chat template")
        self.chat_template = chat_template
        rows = self._load(Path(path), first_id=0)
        if eval_path is not None:
            self._train, self._eval = rows, self._load(Path(eval_path), first_id=len(rows))
        else:
            self._train, self._eval = _split(rows, eval_fraction, seed)

    def train_prompts(self) -> list[Prompt]:
        return self._train

    def eval_prompts(self) -> list[Prompt]:
        return self._eval

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float:
        return self.reward_fn(self.response_text(response_ids), prompt.answer)

    def _load(self, path: Path, first_id: int) -> list[Prompt]:
        if not path.is_file():
            raise UserInputError(f"{path}: no such data file")
        prompts: list[Prompt] = []
        with path.open(encoding="utf-8") as handle:
            for lineno, line in enumerate(handle, start=1):
                if line.strip():
                    where = f"{path}:{lineno}"
                    text, answer = _parse_row(line, where)
                    prompts.append(self._prompt(first_id + len(prompts), text, answer, where))
        if not prompts:
            raise UserInputError(f"{path}: no rows")
        return prompts

    def _prompt(self, prompt_id: int, text: str, answer: str, where: str) -> Prompt:
        ids = self._encode(text)
        if len(ids) + self.max_new_tokens > self.max_model_len:
            raise UserInputError(
                f"{where}: prompt is {len(ids)} tokens; with max_new_tokens={self.max_new_tokens} "
                f"it exceeds the context limit of {self.max_model_len} tokens"
            )
        return Prompt(prompt_id, text, ids, answer)

    def _encode(self, text: str) -> list[int]:
        if self.chat_template:
            messages = [{"role": "user", "content": text}]
            return list(
                self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
        return list(self.tokenizer(text)["input_ids"])


def _parse_row(line: str, where: str) -> tuple[str, str]:
    try:
        row: Any = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UserInputError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(row, dict):
        raise UserInputError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key in ("prompt", "answer"):
        if key not in row:
            raise UserInputError(f"{where}: missing field {key!r}")
    if not isinstance(row["prompt"], str):
        raise UserInputError(f"{where}: field 'prompt' must be a string")
    answer = row["answer"]
    # Numeric answers are common in math data; bools and containers are mistakes.
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise UserInputError(f"{where}: field 'answer' must be a string or a number")
    # an empty answer would reward an empty response; an empty prompt asks nothing
    for key, value in (("prompt", row["prompt"]), ("answer", str(answer))):
        if not value.strip():
            raise UserInputError(f"{where}: field {key!r} is empty")
    return row["prompt"], str(answer)


def _split(rows: list[Prompt], fraction: float, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    if not 0.0 <= fraction < 1.0:
        raise UserInputError(f"task eval_fraction: must be in [0, 1), got {fraction}")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_eval = min(round(len(rows) * fraction), len(rows) - 1)
    if fraction > 0 and len(rows) > 1:
        n_eval = max(n_eval, 1)
    held = set(order[:n_eval])
    return (
        [p for i, p in enumerate(rows) if i not in held],
        [p for i, p in enumerate(rows) if i in held],
    )
