"""Rewards named by the run's keys: built-in names and users' `module:function`s, weighted.

A user's reward is called by keyword with the arguments it names of `row` (the data row,
every field; a built-in task's {"prompt", "answer"}), `response` (the answer text after
reasoning, `Task.answer_text`), `response_ids` (the sampled token ids) and `answer` (the
reference answer as the task reads it); sync or async, it returns a number or a dict of
named numbers (its parts, summed). The reward is the weighted sum of the functions' values.
Invariant: `Rewards.score` never raises and returns within about twice `timeout_s`; a
function that raises, hangs, or returns a non-number or a non-finite one gives reward 0
and an error string, the first of a process logged in one line.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

from dorarl.errors import UserInputError
from dorarl.tasks.bounded_calls import BoundedPool
from dorarl.tasks.env import import_user_module
from dorarl.tasks.rewards import REWARDS

log = logging.getLogger(__name__)

REWARD_ARGS = ("row", "response", "response_ids", "answer")


@dataclass(frozen=True)
class RewardSpec:
    """One reward of a run: a built-in name or 'module:function', and its weight."""

    fn: str
    weight: float = 1.0


@dataclass(frozen=True)
class RewardInput:
    row: dict[str, Any]
    response: str
    response_ids: list[int]
    answer: str


@dataclass
class Scored:
    """A response's reward, its named parts (unweighted; empty on an error), error and
    notes on how it scored (the code task's first failed test)."""

    reward: float
    error: str | None = None
    parts: dict[str, float] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)


def is_user_reward(name: str) -> bool:
    return name not in REWARDS


def parse_reward_specs(value: Any, key: str = "task.rewards") -> list[RewardSpec]:
    """`task.rewards` as written: a list of {fn, weight} (or of compact items), or the compact
    form 'mod:f*0.5,math*1' (weight 1 when no `*w`)."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not items:
        raise UserInputError(f"{key}: expected a list of {{fn, weight}} or 'mod:f*0.5,math'")
    return [_spec(item, f"{key}[{i}]") for i, item in enumerate(items)]


def _spec(item: Any, key: str) -> RewardSpec:
    if isinstance(item, str):
        fn, star, weight = item.strip().rpartition("*") if "*" in item else ("", "", "")
        item = {"fn": fn, "weight": weight} if star else {"fn": item.strip()}
    if not isinstance(item, dict) or not set(item) <= {"fn", "weight"} or not item.get("fn"):
        raise UserInputError(f"{key}: expected {{fn: NAME or module:function, weight: NUMBER}}")
    try:
        weight = float(item.get("weight", 1.0))
    except (TypeError, ValueError):
        raise UserInputError(f"{key}: weight {item['weight']!r} is not a number") from None
    if not math.isfinite(weight):
        raise UserInputError(f"{key}: weight must be finite, got {weight}")
    return RewardSpec(str(item["fn"]).strip(), weight)


@dataclass(frozen=True)
class RewardTerm:
    """A loaded reward: its name (a part's, when it returns a number), weight, function and
    the arguments it takes."""

    name: str
    weight: float
    fn: Callable[..., Any]
    args: tuple[str, ...]

    def value(self, given: RewardInput) -> dict[str, float]:
        out = self.fn(**{a: getattr(given, a) for a in self.args})
        if inspect.isawaitable(out):
            out = asyncio.run(_awaited(out))
        return _parts(self.name, out)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def load_term(spec: RewardSpec, key: str = "task.reward") -> RewardTerm:
    """A built-in name or 'module:function' (the module found as `task.env`'s), checked: it
    takes only arguments of REWARD_ARGS, by keyword. One line naming `key` otherwise."""
    if spec.fn in REWARDS:
        builtin = REWARDS[spec.fn]
        return RewardTerm(spec.fn, spec.weight, _builtin(builtin), ("response", "answer"))
    module_name, _, fn_name = spec.fn.partition(":")
    if not module_name or not fn_name:
        raise UserInputError(
            f"{key}: unknown reward {spec.fn!r}; give a built-in ({', '.join(REWARDS)}) "
            "or 'module:function'"
        )
    fn = getattr(import_user_module(module_name, key), fn_name, None)
    if fn is None or not callable(fn):
        what = "no function" if fn is None else "a non-callable"
        raise UserInputError(f"{key}: module {module_name!r} has {what} {fn_name!r}")
    return RewardTerm(fn_name, spec.weight, fn, _arguments(fn, spec.fn, key))


def _builtin(fn: Callable[[str, str], float]) -> Callable[..., float]:
    def call(response: str, answer: str) -> float:
        return fn(response, answer)

    return call


def _arguments(fn: Callable[..., Any], spec: str, key: str) -> tuple[str, ...]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return REWARD_ARGS
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return REWARD_ARGS
    for p in params:
        unknown = (
            p.name not in REWARD_ARGS and p.default is p.empty and p.kind is not p.VAR_POSITIONAL
        )
        if unknown or (p.name in REWARD_ARGS and p.kind is p.POSITIONAL_ONLY):
            raise UserInputError(
                f"{key}: {spec} takes {p.name!r}; a reward is called by keyword with any of "
                f"{', '.join(REWARD_ARGS)}"
            )
    return tuple(p.name for p in params if p.name in REWARD_ARGS)


def _parts(name: str, out: Any) -> dict[str, float]:
    values = out if isinstance(out, dict) else {name: out}
    if not values:
        raise ValueError("reward returned an empty dict")
    parts = {}
    for part, value in values.items():
        if not isinstance(value, Real):
            raise TypeError(f"reward part {part!r} is {type(value).__name__}, not a number")
        if not math.isfinite(value):
            raise ValueError(f"reward part {part!r} is not finite ({value})")
        parts[str(part)] = float(value)
    return parts


class Rewards:
    """The run's rewards, scored together on a bounded pool of threads; pickled as its specs
    (a Ray worker loads the functions again, from the working directory they came from)."""

    def __init__(self, specs: list[RewardSpec], timeout_s: float, key: str = "task.reward"):
        self.specs, self.timeout_s, self.key = list(specs), timeout_s, key
        self.terms = [load_term(spec, key) for spec in specs]
        self._pool: BoundedPool | None = None
        self._warned = False

    def __reduce__(self) -> tuple:
        return (_restored, (self.specs, self.timeout_s, self.key, os.getcwd()))

    def score(self, inputs: list[RewardInput]) -> list[Scored]:
        """Every input's reward; each function call bounded by `timeout_s`."""
        if self._pool is None:
            self._pool = BoundedPool(min(32, (os.cpu_count() or 1) + 4), self.timeout_s, "rewards")
        calls = [_bind(term, given) for given in inputs for term in self.terms]
        outcomes = iter(self._pool.run_all(calls))
        return [self._combined([next(outcomes) for _ in self.terms]) for _ in inputs]

    def _combined(self, outcomes: list[tuple[Any, BaseException | None]]) -> Scored:
        reward, parts = 0.0, {}
        for term, (values, exc) in zip(self.terms, outcomes, strict=True):
            if exc is None and set(values) & set(parts):
                exc = ValueError(f"reward parts {sorted(set(values) & set(parts))} given twice")
            if exc is not None:
                return self._failed(term, exc)
            parts |= values
            reward += term.weight * sum(values.values())
        return Scored(reward, None, parts)

    def _failed(self, term: RewardTerm, exc: BaseException) -> Scored:
        error = f"{type(exc).__name__}: {exc}"
        if not self._warned:
            self._warned = True
            log.warning(
                "reward %s failed (reward 0, counted in reward_errors): %s", term.name, error
            )
        return Scored(0.0, error)


def _restored(specs: list[RewardSpec], timeout_s: float, key: str, where: str) -> Rewards:
    """Rewards loaded again in another process (a Ray worker), the modules looked for in
    the directory they were loaded from as well, after the worker's own path."""
    if where not in sys.path:
        sys.path.append(where)
    return Rewards(specs, timeout_s, key)


def _bind(term: RewardTerm, given: RewardInput) -> Callable[[], dict[str, float]]:
    return lambda: term.value(given)
