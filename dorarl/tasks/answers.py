"""Final-answer extraction: the one string of a response that a math reward may judge.

Order, as peers' verifiers do: the last `\\boxed{}`; else what follows the last "answer is"
(or "answer:", or GSM8K's "####", where its references are read); else the last "="
statement; else the last math span or the last number. Invariant: an unevaluated
arithmetic expression (`91 + 67`, say, copied from the question) is never an answer, so
restating the question earns nothing.
"""

from __future__ import annotations

import re

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_IS = re.compile(r"answer(?:\s+is\b|\s*:)|####", re.IGNORECASE)
# "=" but not "<=", ">=", "!=" or "=>"; a run of "=" counts as one.
_EQUALS = re.compile(r"(?<![<>!=])=+(?!>)")
# Where a statement ends: a line break, "?", "!", ";", or a period that is no decimal point.
_STATEMENT_END = re.compile(r"\n|[?!;]|\.(?!\d)")
_MATH_SPAN = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.DOTALL)
_NUMBER = re.compile(r"(?:(?<![\w)\]}])-)?(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")
# A word of prose: two or more letters that are not part of a LaTeX command.
_PROSE_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}")
_LATEX_OPERATORS = re.compile(r"\\(?:times|cdot|div)(?![A-Za-z])")
_ARITHMETIC_ONLY = re.compile(r"[\d\s.,+\-*/×÷·()\[\]{}^]*\d[\d\s.,+\-*/×÷·()\[\]{}^]*")
_BINARY_OPERATOR = re.compile(r"[\d)\]}]\s*[+\-*×÷·]\s*[\d(\[{\-]")
_EDGE_JUNK = " \t\n,;:!?*`"
# Math delimiters ($, \\( \\), \\[ \\]) say nothing about the value; text commands keep their words.
_DELIMITERS = re.compile(r"\\[()\[\]]|\$")
_TEXT_COMMAND = re.compile(r"\\(?:text|mathrm|textbf|mbox)\s*\{([^{}]*)\}")
# A stretch worth reading: it holds a digit, a LaTeX command, or is one letter (`x`).
_MATH_CHUNK = re.compile(r"[\d\\]|^\W*[A-Za-z]\W*$")


def extract_final_answer(response: str) -> str | None:
    """The response's final answer as a string for a verifier, or None when it states none.

    A stage that finds its anchor but no value there (`\\boxed{91+67}`, "the answer is
    unclear", "91 + 67 = ?") hands on only the text after that anchor's statement."""
    boxed = _last_boxed_span(response)
    if boxed is not None:
        value = _value(response[boxed[0] : boxed[1]])
        if value is not None:
            return value
        response = response[boxed[1] + 1 :]
    answer_is = list(_ANSWER_IS.finditer(response))
    if answer_is:
        tail = response[answer_is[-1].end() :]
        lead = len(tail) - len(tail.lstrip(_EDGE_JUNK))
        end = _statement_end(tail, lead)
        value = _value(tail[lead:end])
        if value is not None:
            return value
        response = tail[end:]
    equals = list(_EQUALS.finditer(response))
    if equals:
        start, end = _statement_around(response, equals[-1].start())
        value = _equation_value(response[start:end])
        if value is not None:
            return value
        response = response[end:]
    return _last_math(response)


def _last_math(text: str) -> str | None:
    """No anchor: the last $...$ span if it holds a value, the whole text if it is all math
    (`2\\sqrt{2}`), else the last number."""
    spans = list(_MATH_SPAN.finditer(text))
    if spans:
        value = _value(next(g for g in spans[-1].groups() if g is not None), keep="last")
        if value is not None:
            return value
        text = text[spans[-1].end() :]
    if text.strip() and not _PROSE_WORD.search(_TEXT_COMMAND.sub(" ", text)):
        value = _value(text, keep="last")
        if value is not None:
            return value
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def last_boxed(text: str) -> str | None:
    """The contents of the last `\\boxed{...}` (braces balanced), or None."""
    span = _last_boxed_span(text)
    return text[span[0] : span[1]] if span else None


def _last_boxed_span(text: str) -> tuple[int, int] | None:
    """[start, end) of the last boxed contents; `text[end]` is its closing brace."""
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    depth, start = 1, matches[-1].end()
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return start, i
    return None  # unclosed: the model never finished its answer


def is_unevaluated_arithmetic(text: str) -> bool:
    """True for numbers joined by + - * x / etc. with a binary operator other than a lone
    fraction bar: `91 + 67`, `3 \\times 4`, `10-2`; False for `-5`, `1/2`, `2^{10}`, `1+\\sqrt{2}`."""
    plain = _LATEX_OPERATORS.sub("×", text).strip()
    return bool(_ARITHMETIC_ONLY.fullmatch(plain) and _BINARY_OPERATOR.search(plain))


def _value(candidate: str, keep: str = "first") -> str | None:
    """A stated value from a candidate: its first (or last) stretch of math between words of
    prose, an equation reduced to its value, and never unevaluated arithmetic."""
    chunk = _math_chunk(candidate, keep)
    if _EQUALS.search(chunk):
        return _equation_value(chunk)
    if not chunk or is_unevaluated_arithmetic(chunk):
        return None
    return chunk


def _math_chunk(candidate: str, keep: str) -> str:
    text = _DELIMITERS.sub(" ", _TEXT_COMMAND.sub(r" \1 ", candidate))
    chunks = [c for c in _PROSE_WORD.split(text) if _MATH_CHUNK.search(c)]
    if not chunks:
        return ""
    return _strip(chunks[0] if keep == "first" else chunks[-1])


def _equation_value(statement: str) -> str | None:
    """The last side of `a = b = c` that is a value, walking left only over unevaluated
    arithmetic: `91 + 67 = 158` and `158 = 91 + 67` give 158; `91 + 67 = ?` gives None
    (an equation that asks states nothing)."""
    sides = _EQUALS.split(statement)
    for index in range(len(sides) - 1, -1, -1):
        # The right-hand side starts the statement's tail; the others end where "=" begins.
        chunk = _math_chunk(sides[index], keep="first" if index == len(sides) - 1 else "last")
        if chunk and not is_unevaluated_arithmetic(chunk):
            return chunk
        if not is_unevaluated_arithmetic(chunk):
            return None
    return None


def _statement_end(text: str, position: int) -> int:
    match = _STATEMENT_END.search(text, position)
    return match.start() if match else len(text)


def _statement_around(text: str, position: int) -> tuple[int, int]:
    """[start, end) of the statement holding `position`, between the statement ends around it."""
    ends_before = [m.end() for m in _STATEMENT_END.finditer(text, 0, position)]
    return (ends_before[-1] if ends_before else 0), _statement_end(text, position)


def _strip(text: str) -> str:
    """Surrounding punctuation and markdown emphasis removed."""
    previous = None
    while previous != text:
        previous = text
        text = text.strip(_EDGE_JUNK).rstrip(".")
    return text
