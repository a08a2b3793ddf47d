"""A task from data: rows of JSON lines, Parquet or a Hugging Face data set held here (a
`save_to_disk` folder or a cached name, `dorarl.tasks.hf_datasets`) in one of the row formats.

Formats (`dorarl.tasks.formats`): `prompt_answer` {"prompt", "answer"}, `gsm8k`
{"question", "answer" ending in `#### N`}, `math` {"problem", "solution" with a
`\\boxed{}` answer}; `prompt_template` builds the prompt from the row's fields, and
`chat_template` renders it as a user message (after `system_prompt`, if given).
Invariants: loading either returns well-formed prompts that fit the context or raises a
`UserInputError` naming the file and its line (or Parquet or data set row); blank lines are skipped
and every field is kept (`Prompt.row`, what a user's reward reads). The held-out set is
`eval_path` if given, else a seeded `eval_fraction` of the rows; the training rows are
dispatched in a seeded order (`shuffle`), else in the file's.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from dorarl.errors import UserInputError
from dorarl.tasks.base import Prompt, Task
from dorarl.tasks.data_files import read_rows
from dorarl.tasks.formats import check_template, get_format, prompt_text
from dorarl.tasks.hf_datasets import DataSource, read_data_set
from dorarl.tasks.model_files import context_limit, load_tokenizer, stop_ids
from dorarl.tasks.rewards import get_reward


class JsonlTask(Task):
    name = "jsonl"

    def __init__(
        self,
        path: str | Path,
        reward: str = "exact",
        split: str | None = None,
        eval_split: str | None = None,
        tokenizer: str | Path | PreTrainedTokenizerBase | None = None,
        eval_path: str | Path | None = None,
        eval_fraction: float = 0.1,
        seed: int = 0,
        max_new_tokens: int = 256,
        max_model_len: int | None = None,
        chat_template: bool = False,
        format: str = "prompt_answer",
        prompt_template: str | None = None,
        system_prompt: str | None = None,
        shuffle: bool = True,
    ):
        try:
            self.reward_fn = get_reward(reward)
        except ValueError as exc:
            raise UserInputError(f"task reward: {exc}") from None
        self.format = get_format(format)
        if prompt_template is not None:
            check_template(prompt_template)
        self.prompt_template, self.system_prompt = prompt_template, system_prompt
        self.tokenizer, model_dir = load_tokenizer(tokenizer)
        self.stop_token_ids = stop_ids(self.tokenizer, model_dir)
        self.max_new_tokens = max_new_tokens
        self.max_model_len = max_model_len or context_limit(model_dir, self.tokenizer)
        self.chat_template = _checked_chat_template(
            chat_template, system_prompt, self.tokenizer, model_dir
        )
        rows = self._load(DataSource(str(path), "task.path", split, "task.split"), first_id=0)
        if eval_path is not None:
            held = DataSource(str(eval_path), "task.eval_path", eval_split, "task.eval_split")
            self._train, self._eval = rows, self._load(held, first_id=len(rows))
        else:
            self._train, self._eval = _split(rows, eval_fraction, seed)
        if shuffle:  # a file sorted by topic or difficulty would otherwise be trained in blocks
            random.Random(f"jsonl/train-order/{seed}").shuffle(self._train)

    def train_prompts(self) -> list[Prompt]:
        return self._train

    def eval_prompts(self) -> list[Prompt]:
        return self._eval

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float:
        return self.reward_fn(self.answer_text(response_ids, prompt), prompt.answer)

    def _load(self, source: DataSource, first_id: int) -> list[Prompt]:
        prompts: list[Prompt] = []
        for where, row in source_rows(source):
            text, answer = prompt_text(self.format, self.prompt_template, row, where)
            prompts.append(self._prompt(first_id + len(prompts), text, answer, where, row))
        if not prompts:
            raise UserInputError(f"{source.value}: no rows")
        return prompts

    def _prompt(
        self, prompt_id: int, text: str, answer: str, where: str, row: dict[str, Any]
    ) -> Prompt:
        ids = self._encode(text)
        if len(ids) + self.max_new_tokens > self.max_model_len:
            raise UserInputError(
                f"{where}: prompt is {len(ids)} tokens; with max_new_tokens={self.max_new_tokens} "
                f"(sampling.max_new_tokens) it exceeds the context limit of {self.max_model_len} "
                "tokens; raise engine.max_model_len or lower sampling.max_new_tokens"
            )
        return Prompt(prompt_id, text, ids, answer, row)

    def _encode(self, text: str) -> list[int]:
        if not self.chat_template:
            return list(self.tokenizer(text)["input_ids"])
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return list(
            self.tokenizer.apply_chat_template(
                [*system, *self._before_prompt(), {"role": "user", "content": text}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )

    def _before_prompt(self) -> list[dict[str, str]]:
        """Chat messages between the system prompt and each prompt (a task's worked
        example); none here."""
        return []


def source_rows(source: DataSource) -> Iterator[tuple[str, Any]]:
    """A data file's rows, else a data set's (a folder or a cached name)."""
    path = Path(source.value)
    if not path.is_file():
        return read_data_set(source)
    if source.split is not None:
        raise UserInputError(f"{source.split_key}: {path} is a data file, a single split")
    return read_rows(path)


def _checked_chat_template(
    wanted: bool,
    system_prompt: str | None,
    tokenizer: PreTrainedTokenizerBase,
    model_dir: Path | None,
) -> bool:
    if wanted and not getattr(tokenizer, "chat_template", None):
        model = model_dir if model_dir is not None else "the given tokenizer"
        raise UserInputError(f"task.chat_template=true: {model} has no chat template")
    if system_prompt is not None and not wanted:
        raise UserInputError(
            "task.system_prompt: a system message needs task.chat_template=true for jsonl data"
        )
    return wanted


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
