"""Reward functions `(response_text, answer) -> float` for the generic JSONL task.

`exact`: 1.0 when the response equals the answer after stripping surrounding whitespace.
`math`: 1.0 when math-verify finds the response's final answer equivalent to the reference
(1/2, 0.5 and \\frac{1}{2} agree). Rewards may raise on hostile input; callers go
through `dorarl.tasks.score`, which turns an exception into reward 0 and a counted error.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

RewardFn = Callable[[str, str], float]


def exact_match(response: str, answer: str) -> float:
    return 1.0 if response.strip() == answer.strip() else 0.0


def math_equivalent(response: str, answer: str) -> float:
    """math-verify equivalence of the response's final answer and the reference answer."""
    from math_verify import parse, verify  # imported lazily: sympy/latex2sympy load slowly

    # math-verify's timeouts use signal.alarm, which only works on the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = _parse_gold(parse, answer, timeout)
    if not gold:
        raise ValueError(f"reference answer {answer!r} is not a parseable math expression")
    predicted = parse(response, parsing_timeout=timeout)
    if not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=timeout) else 0.0


def _parse_gold(parse: Callable, answer: str, timeout: int | None) -> list:
    # References are often bare LaTeX ("\frac{1}{2}"); retry inside $...$ if needed.
    gold = parse(answer, parsing_timeout=timeout)
    if not _has_expression(gold) and "$" not in answer:
        gold = parse(f"${answer}$", parsing_timeout=timeout)
    return gold if _has_expression(gold) else []


def _has_expression(parsed: list) -> bool:
    """math-verify returns [sympy expr, source string]; a lone string means no expression."""
    return any(not isinstance(item, str) for item in parsed)


REWARDS: dict[str, RewardFn] = {"exact": exact_match, "math": math_equivalent}


def get_reward(name: str) -> RewardFn:
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; choose one of {sorted(REWARDS)}")
    return REWARDS[name]
