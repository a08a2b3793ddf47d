"""Reward functions `(response_text, answer) -> float` for the generic JSONL task.

Tasks pass the response's answer (`Task.answer_text`: the text after its reasoning).

`exact`: 1.0 when the response equals the answer after stripping surrounding whitespace.
`math`: 1.0 when the response's final answer (`dorarl.tasks.answers`: boxed, "answer is",
"=", last number; never unevaluated arithmetic copied from the question, never a hedge such
as "5 or 6") is equivalent to the reference: equal numbers directly, anything else through math-verify (1/2, 0.5 and
\\frac{1}{2} agree). Rewards may raise on hostile input; callers go through
`dorarl.tasks.score`, which turns an exception into reward 0 and a counted error.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from fractions import Fraction

from dorarl.tasks.answers import extract_final_answer

RewardFn = Callable[[str, str], float]


def exact_match(response: str, answer: str) -> float:
    return 1.0 if response.strip() == answer.strip() else 0.0


def math_equivalent(response: str, answer: str) -> float:
    """1.0 when the response's extracted final answer equals the reference answer. A
    reference math-verify cannot read raises whatever the response (a data error to count)."""
    gold_number = _plain_number(answer)
    timeout = _timeout()
    gold = _parsed_reference(answer, timeout) if gold_number is None else None
    predicted = extract_final_answer(response)
    if predicted is None:
        return 0.0
    predicted_number = _plain_number(predicted)
    if gold_number is not None and predicted_number is not None:
        return 1.0 if gold_number == predicted_number else 0.0
    from math_verify import verify  # imported lazily: sympy/latex2sympy load slowly

    gold = gold or _parsed_reference(answer, timeout)
    parsed = _parse_math(predicted, timeout)
    return 1.0 if parsed and verify(gold, parsed, timeout_seconds=timeout) else 0.0


_PLAIN_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\d+/\d+")


def _plain_number(text: str) -> Fraction | None:
    """The exact value of a plain number (`158`, `-3.5`, `1,000`, `1/2`): compared without
    sympy; None for anything else."""
    text = text.strip()
    if not _PLAIN_NUMBER.fullmatch(text):
        return None
    try:
        return Fraction(text.replace(",", ""))
    except ZeroDivisionError:
        return None


def _timeout() -> int | None:
    # math-verify's timeouts use signal.alarm, which only works on the main thread.
    return 5 if threading.current_thread() is threading.main_thread() else None


class _NoTimeoutNotice(logging.Filter):
    """Drops math-verify's warning that its timeout is off: off the main thread it must be,
    and the episode's own bound (`task.env_timeout_s`) limits the wait instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_NoTimeoutNotice())


def _parsed_reference(answer: str, timeout: int | None) -> list:
    gold = _parse_math(answer, timeout)
    if not gold:
        raise ValueError(f"reference answer {answer!r} is not a parseable math expression")
    return gold


def _parse_math(text: str, timeout: int | None) -> list:
    """math-verify's parse of the whole string as one expression: bare text is read as LaTeX
    inside $...$ (so `2\\sqrt{2}` is not cut to its first number), else as it stands."""
    from math_verify import parse

    attempts = [text] if "$" in text else [f"${text}$", text]
    for attempt in attempts:
        parsed = parse(attempt, parsing_timeout=timeout)
        if _has_expression(parsed):
            return parsed
    return []


def _has_expression(parsed: list) -> bool:
    """math-verify returns [sympy expr, source string]; a lone string means no expression."""
    return any(not isinstance(item, str) for item in parsed)


REWARDS: dict[str, RewardFn] = {"exact": exact_match, "math": math_equivalent}


def get_reward(name: str) -> RewardFn:
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; choose one of {sorted(REWARDS)}")
    return REWARDS[name]
