"""`make_task(name, **options)`: the built-in tasks by name."""

from __future__ import annotations

from typing import Any

from dorarl.errors import UserInputError
from dorarl.tasks.arith import ArithConfig, ArithTask
from dorarl.tasks.base import Task
from dorarl.tasks.calculator import CalculatorConfig, CalculatorTask
from dorarl.tasks.code import CodeTask
from dorarl.tasks.jsonl import JsonlTask
from dorarl.tasks.multiturn_sum import MultiTurnSumConfig, MultiTurnSumTask
from dorarl.tasks.running_sum import RunningSumConfig, RunningSumTask

TASK_NAMES = ("running_sum", "jsonl", "arith", "multiturn_sum", "calculator", "code")


def make_task(name: str, **options: Any) -> Task:
    """`make_task("running_sum", seed=0, n_train=...)`, `make_task("jsonl", path=..., ...)` or
    `make_task("arith", tokenizer=MODEL_DIR, max_value=99, ...)`."""
    if name == "running_sum":
        return _running_sum(**options)
    if name == "arith":
        return _arith(**options)
    if name == "multiturn_sum":
        return _multiturn_sum(**options)
    if name == "calculator":
        return _calculator(**options)
    if name == "jsonl":
        if "path" not in options:
            raise UserInputError("task jsonl: needs a data file (path=...)")
        return JsonlTask(**options)
    if name == "code":
        return CodeTask(**options)
    raise UserInputError(f"unknown task {name!r}; choose one of {', '.join(TASK_NAMES)}")


def _running_sum(seed: int = 0, tokenizer: Any = None, **fields: Any) -> RunningSumTask:
    try:
        config = RunningSumConfig(**fields)
    except (TypeError, ValueError) as exc:
        raise UserInputError(f"task running_sum: {exc}") from None
    return RunningSumTask(seed=seed, config=config, tokenizer=tokenizer)


def _arith(
    seed: int = 0,
    tokenizer: Any = None,
    max_new_tokens: int = 64,
    max_model_len: int | None = None,
    **fields: Any,
) -> ArithTask:
    try:
        config = ArithConfig(**fields)
    except (TypeError, ValueError) as exc:
        raise UserInputError(f"task arith: {exc}") from None
    return ArithTask(tokenizer, seed, config, max_new_tokens, max_model_len)


def _multiturn_sum(
    seed: int = 0,
    tokenizer: Any = None,
    latency_s: float = 0.0,
    timeout_s: float = 30.0,
    max_turns: int = 0,
    **fields: Any,
) -> MultiTurnSumTask:
    try:
        config = MultiTurnSumConfig(seed=seed, **fields)
    except (TypeError, ValueError) as exc:
        raise UserInputError(f"task multiturn_sum: {exc}") from None
    task = MultiTurnSumTask(config, tokenizer, latency_s, timeout_s)
    task.max_turns = max_turns or task.max_turns
    return task


def _calculator(
    seed: int = 0,
    tokenizer: Any = None,
    max_new_tokens: int = 40,
    max_model_len: int | None = None,
    latency_s: float = 0.0,
    timeout_s: float = 30.0,
    **fields: Any,
) -> CalculatorTask:
    try:
        config = CalculatorConfig(**fields)
    except TypeError as exc:
        raise UserInputError(f"task calculator: {exc}") from None
    except ValueError as exc:  # its message starts with the key
        raise UserInputError(f"task.{exc}") from None
    return CalculatorTask(
        tokenizer, seed, config, max_new_tokens, max_model_len, latency_s, timeout_s
    )
