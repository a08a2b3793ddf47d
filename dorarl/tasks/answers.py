"""Final-answer extraction: the one string of a response that a math reward may judge.

Order, as peers' verifiers do: the last `\\boxed{}`; else what follows the last "answer is"
(or "answer:", or GSM8K's "####", where its references are read); else the last "="
statement; else the last math span or the last number. Invariants: an unevaluated
arithmetic expression (`91 + 67`, say, copied from the question) is never an answer, so
restating the question earns nothing; an answer that offers several values ("5 or 6",
"between 5 and 6", `5 \\vee 6`, `\\boxed{5} or \\boxed{6}`) is none, so hedging earns
nothing either. A list written as one piece ("5, 6") stays one answer, for a verifier to
compare as a whole.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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
_PROSE_SPLIT = re.compile(f"({_PROSE_WORD.pattern})")
_LATEX_OPERATORS = re.compile(r"\\(?:times|cdot|div)(?![A-Za-z])")
_ARITHMETIC_ONLY = re.compile(r"[\d\s.,+\-*/×÷·()\[\]{}^]*\d[\d\s.,+\-*/×÷·()\[\]{}^]*")
_BINARY_OPERATOR = re.compile(r"[\d)\]}]\s*[+\-*×÷·]\s*[\d(\[{\-]")
_EDGE_JUNK = " \t\n,;:!?*`"
# Math delimiters ($, \\( \\), \\[ \\]) say nothing about the value; text commands keep their
# words, and a logical or (`\\lor`, `\\vee`, ∨) reads as the word.
_DELIMITERS = re.compile(r"\\[()\[\]]|\$")
_TEXT_COMMAND = re.compile(r"\\(?:text|mathrm|textbf|mbox)\s*\{([^{}]*)\}")
_LOGICAL_OR = re.compile(r"\\(?:lor|vee)(?![A-Za-z])|∨")
# A stretch worth reading: it holds a digit, a LaTeX command, or is one letter (`x`).
_MATH_CHUNK = re.compile(r"[\d\\]|^\W*[A-Za-z]\W*$")


@dataclass(frozen=True)
class _Chunk:
    """A stretch of math in a candidate, and the words of prose between it and the one before."""

    text: str
    words: tuple[str, ...]


def extract_final_answer(response: str) -> str | None:
    """The response's final answer as a string for a verifier, or None when it states none.

    A stage that finds its anchor but no value there (`\\boxed{91+67}`, "the answer is
    unclear", "91 + 67 = ?") hands on only the text after that anchor's statement; one that
    finds several values offered there ends the search: the response hedged."""
    found = _stated_answer(response)
    if found is None:
        return None
    value, statement = found
    return None if _offers_others(statement, value) else value


def _stated_answer(response: str) -> tuple[str, str] | None:
    """(the value, the statement it was read from) of the first stage that finds one."""
    boxed = _last_boxed_span(response)
    if boxed is not None:
        value = _value(response[boxed[0] : boxed[1]])
        if value is not None:
            return value, _box_statement(response, boxed)
        response = response[boxed[1] + 1 :]
    answer_is = list(_ANSWER_IS.finditer(response))
    if answer_is:
        tail = response[answer_is[-1].end() :]
        lead = len(tail) - len(tail.lstrip(_EDGE_JUNK))
        end = _statement_end(tail, lead)
        value = _value(tail[lead:end])
        if value is not None:
            return value, tail[lead:end]
        response = tail[end:]
    equals = list(_EQUALS.finditer(response))
    if equals:
        start, end = _statement_around(response, equals[-1].start())
        value = _equation_value(response[start:end])
        if value is not None:
            return value, response[start:end]
        response = response[end:]
    return _last_math(response)


def _last_math(text: str) -> tuple[str, str] | None:
    """No anchor: the last $...$ span if it holds a value, the whole text if it is all math
    (`2\\sqrt{2}`), else the last number; with the statement each was read from."""
    spans = list(_MATH_SPAN.finditer(text))
    if spans:
        span = next(g for g in spans[-1].groups() if g is not None)
        value = _value(span, keep="last")
        if value is not None:
            return value, span
        text = text[spans[-1].end() :]
    if text.strip() and not _PROSE_WORD.search(_TEXT_COMMAND.sub(" ", text)):
        value = _value(text, keep="last")
        if value is not None:
            return value, text
    numbers = list(_NUMBER.finditer(text))
    if not numbers:
        return None
    start, end = _statement_around(text, numbers[-1].start())
    return numbers[-1].group(), text[start:end]


def last_boxed(text: str) -> str | None:
    """The contents of the last `\\boxed{...}` (braces balanced), or None."""
    span = _last_boxed_span(text)
    return text[span[0] : span[1]] if span else None


def _last_boxed_span(text: str) -> tuple[int, int] | None:
    """[start, end) of the last boxed contents; `text[end]` is its closing brace."""
    matches = list(_BOXED.finditer(text))
    return _box_contents(text, matches[-1].end()) if matches else None


def _box_contents(text: str, start: int) -> tuple[int, int] | None:
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return start, i
    return None  # unclosed: the model never finished its answer


def _box_statement(text: str, span: tuple[int, int]) -> str:
    """The boxed contents, after those of the box before when no more than a joiner stands
    between the two (`\\boxed{5} or \\boxed{6}`, `\\boxed{5}, \\boxed{6}` read as "5 or 6")."""
    contents = text[span[0] : span[1]]
    command = next(m for m in _BOXED.finditer(text) if m.end() == span[0]).start()
    for match in reversed(list(_BOXED.finditer(text, 0, command))):
        before = _box_contents(text, match.end())
        if before is None or before[1] >= command:
            continue  # unclosed, or the box around this one
        words = tuple(w.lower() for w in _PROSE_WORD.findall(_plain(text[before[1] + 1 : command])))
        if not words or _hedges(words):
            return f"{text[before[0] : before[1]]} {' '.join(words) or 'or'} {contents}"
        break
    return contents


def is_unevaluated_arithmetic(text: str) -> bool:
    """True for numbers joined by + - * x / etc. with a binary operator other than a lone
    fraction bar: `91 + 67`, `3 \\times 4`, `10-2`; False for `-5`, `1/2`, `2^{10}`, `1+\\sqrt{2}`."""
    plain = _LATEX_OPERATORS.sub("×", text).strip()
    return bool(_ARITHMETIC_ONLY.fullmatch(plain) and _BINARY_OPERATOR.search(plain))


def _value(candidate: str, keep: str = "first") -> str | None:
    """A stated value from a candidate: its first (or last) stretch of math between words of
    prose, an equation reduced to its value, and never unevaluated arithmetic."""
    return _chunk_value(_math_chunk(candidate, keep))


def _chunk_value(chunk: str) -> str | None:
    if _EQUALS.search(chunk):
        return _equation_value(chunk)
    if not chunk or is_unevaluated_arithmetic(chunk):
        return None
    return chunk


def _math_chunk(candidate: str, keep: str) -> str:
    chunks = _chunks(candidate)
    if not chunks:
        return ""
    return (chunks[0] if keep == "first" else chunks[-1]).text


def _chunks(candidate: str) -> list[_Chunk]:
    """The candidate's stretches of math, cut at words of prose."""
    pieces = _PROSE_SPLIT.split(_plain(candidate))  # text, word, text, word, ..., text
    chunks: list[_Chunk] = []
    words: list[str] = []
    for index, piece in enumerate(pieces):
        if index % 2:
            words.append(piece.lower())
        elif _MATH_CHUNK.search(piece):
            chunks.append(_Chunk(_strip(piece), tuple(words)))
            words = []
    return chunks


def _plain(text: str) -> str:
    text = _LOGICAL_OR.sub(" or ", _TEXT_COMMAND.sub(r" \1 ", text))
    return _DELIMITERS.sub(" ", text)


def _offers_others(statement: str, value: str) -> bool:
    """True when `value` stands in its statement next to a different value with a hedge
    between the two: "5 or 6", "either 5 or 6", "5 and/or 6", "between 5 and 6",
    "x = 5 or x = 6". Other values around it ("158, not 157", "91 and 67 give 158") are
    working or prose, not a second answer."""
    chunks = _chunks(statement)
    key = _key(value)
    # A chunk's value is a piece of it: only chunks holding the key's text need reading.
    holding = [i for i, c in enumerate(chunks) if key in _key(c.text)]
    for index in {j for i in holding for j in (i, i + 1) if 0 < j < len(chunks)}:
        first, second = _claim(chunks[index - 1].text), _claim(chunks[index].text)
        if first is None or second is None or key not in (first[1], second[1]):
            continue
        if first[1] != second[1] and _hedges(chunks[index].words, first[0], second[0]):
            return True
    return False


def _claim(chunk: str) -> tuple[str, str] | None:
    """(what it is said of, the value) of a chunk: ("x", "5") for `x = 5`, ("", "5") for 5."""
    value = _chunk_value(chunk)
    if value is None:
        return None
    subject = _EQUALS.split(chunk)[0] if _EQUALS.search(chunk) else ""
    return _key(subject), _key(value)


def _hedges(words: tuple[str, ...], subject: str = "", other: str = "") -> bool:
    """Two values joined by `words` are offered as alternatives: an "or", or a bare "and"
    between values of one thing ("5 and 6", but not "x = 2 and y = 3")."""
    if "or" in words:
        return True
    return words == ("and",) and (subject == other or not subject or not other)


def _key(text: str) -> str:
    return re.sub(r"\s+", "", text)


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
