"""Row formats of data files: what a row must hold, its prompt text and its reference answer.

`prompt_answer`: {"prompt", "answer"} (a string or a number), as written. `gsm8k`:
{"question", "answer"}, the reference being what follows the answer's last `####`.
`math`: {"problem", "solution"}, the reference being the solution's last `\\boxed{}`
(nested braces balanced), found by the same code that reads a response's boxed answer.
The prompt is the question field, or `prompt_template` (a Python format string) filled
with the row's fields. Invariant: a row either gives a non-empty prompt and reference or
raises `UserInputError` naming its place and the field.
"""

from __future__ import annotations

import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dorarl.errors import UserInputError
from dorarl.tasks.answers import last_boxed

GSM8K_MARK = "####"


@dataclass(frozen=True)
class RowFormat:
    name: str
    question: str  # the field shown as the prompt when there is no template
    reference: Callable[[dict[str, Any], str], str]  # (row, place) -> reference answer


def _prompt_answer_reference(row: dict[str, Any], where: str) -> str:
    answer = _field(row, "answer", where, numbers=True)
    return str(answer)


def _gsm8k_reference(row: dict[str, Any], where: str) -> str:
    answer = _field(row, "answer", where)
    if GSM8K_MARK not in answer:
        raise UserInputError(f"{where}: field 'answer' has no final answer after '{GSM8K_MARK}'")
    final = answer.rsplit(GSM8K_MARK, 1)[1].strip()
    if not final:
        raise UserInputError(f"{where}: field 'answer' is empty after '{GSM8K_MARK}'")
    return final


def _math_reference(row: dict[str, Any], where: str) -> str:
    boxed = last_boxed(_field(row, "solution", where))
    if boxed is None:
        raise UserInputError(f"{where}: field 'solution' has no closed \\boxed{{}} answer")
    if not boxed.strip():
        raise UserInputError(f"{where}: field 'solution' has an empty \\boxed{{}}")
    return boxed.strip()


FORMATS = {
    "prompt_answer": RowFormat("prompt_answer", "prompt", _prompt_answer_reference),
    "gsm8k": RowFormat("gsm8k", "question", _gsm8k_reference),
    "math": RowFormat("math", "problem", _math_reference),
}


def get_format(name: str) -> RowFormat:
    if name not in FORMATS:
        raise UserInputError(f"task.format: unknown format {name!r}; choose one of {list(FORMATS)}")
    return FORMATS[name]


def _field(row: dict[str, Any], key: str, where: str, numbers: bool = False) -> Any:
    """A present, non-empty string field (or a number, where `numbers`)."""
    if key not in row:
        raise UserInputError(f"{where}: missing field {key!r}")
    value = row[key]
    # Numeric answers are common in math data; bools and containers are mistakes.
    if numbers and (isinstance(value, bool) or not isinstance(value, str | int | float)):
        raise UserInputError(f"{where}: field {key!r} must be a string or a number")
    if not numbers and not isinstance(value, str):
        raise UserInputError(f"{where}: field {key!r} must be a string")
    # an empty answer would reward an empty response; an empty prompt asks nothing
    if not str(value).strip():
        raise UserInputError(f"{where}: field {key!r} is empty")
    return value


def check_template(template: str) -> None:
    """Refuse a template that is not a format string over named fields."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise UserInputError(
            f"task.prompt_template: {exc} (write a literal brace as {{{{ or }}}})"
        ) from None
    if any(name == "" or name.isdigit() for name in fields):
        raise UserInputError(
            "task.prompt_template: name the row's fields, e.g. {question}; {} and {0} name none"
        )


def prompt_text(fmt: RowFormat, template: str | None, row: Any, where: str) -> tuple[str, str]:
    """(prompt text, reference answer) of one row."""
    if not isinstance(row, dict):
        raise UserInputError(f"{where}: expected a JSON object, got {type(row).__name__}")
    question = _field(row, fmt.question, where)
    reference = fmt.reference(row, where)
    text = question if template is None else _render(template, row, where)
    if not text.strip():
        raise UserInputError(f"{where}: task.prompt_template gives an empty prompt")
    return text, reference


def _render(template: str, row: dict[str, Any], where: str) -> str:
    try:
        return template.format_map(row)
    except KeyError as exc:
        raise UserInputError(
            f"{where}: task.prompt_template names field {exc.args[0]!r}, which the row lacks"
        ) from None
    except (AttributeError, IndexError, TypeError, ValueError) as exc:
        raise UserInputError(f"{where}: task.prompt_template: {exc}") from None
