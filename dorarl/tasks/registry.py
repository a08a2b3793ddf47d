"""`make_task(name, **options)`: the built-in tasks by name."""

from __future__ import annotations

from typing import Any

from dorarl.errors import UserInputError
from dorarl.tasks.base import Task
from dorarl.tasks.jsonl import JsonlTask
from dorarl.tasks.running_sum import RunningSumConfig, RunningSumTask

TASK_NAMES = ("running_sum", "jsonl")


def make_task(name: str, **options: Any) -> Task:
    """`make_task("running_sum", seed=0, n_train=...)` or `make_task("jsonl", path=..., ...)`."""
    if name == "running_sum":
        return _running_sum(**options)
    if name == "jsonl":
        if "path" not in options:
            raise UserInputError("task jsonl: needs a data file (path=...)")
        return JsonlTask(**options)
    raise UserInputError(f"unknown task {name!r}; choose one of {', '.join(TASK_NAMES)}")


def _running_sum(seed: int = 0, tokenizer: Any = None, **fields: Any) -> RunningSumTask:
    try:
        config = RunningSumConfig(**fields)
    except (TypeError, ValueError) as exc:
        raise UserInputError(f"task running_sum: {exc}") from None
    return RunningSumTask(seed=seed, config=config, tokenizer=tokenizer)
