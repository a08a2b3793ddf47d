"""A code problem's tests, read from its data row, and how one program fares on one test.

A row's `tests` is a list of {"stdin": TEXT, "stdout": TEXT} (the program reads the one
and must print the other, compared line by line with trailing spaces and blank lines at
the end ignored) or {"assert": CODE} (Python run after the program, in its namespace: the
test passes when it exits 0). Invariant: `read_tests` returns at least one well-formed
test or raises `UserInputError` naming the row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dorarl.errors import UserInputError
from dorarl.tasks.code_blocks import LANGUAGES
from dorarl.tasks.sandbox import RunResult


@dataclass(frozen=True)
class CodeTest:
    stdin: str = ""
    stdout: str | None = None  # an I/O test's expected output
    check: str | None = None  # an assert test's code

    def program(self, code: str) -> str:
        """The source the sandbox runs for this test."""
        return code if self.check is None else f"{code}\n\n{self.check}\n"

    def failure(self, result: RunResult) -> str | None:
        """Why the program failed this test, in a line (None: it passed)."""
        cause = result.cause()
        if cause == "AssertionError" and self.check is not None:
            return f"AssertionError: {_short(self.check)}"
        if cause is not None:
            return cause
        if self.stdout is not None and _lines(result.stdout) != _lines(self.stdout):
            return f"wrong output: expected {_short(self.stdout)}, got {_short(result.stdout)}"
        return None


def read_tests(row: dict[str, Any], where: str) -> list[CodeTest]:
    """The row's tests (its `language` must be one the task runs)."""
    language = row.get("language", "python")
    if language not in LANGUAGES:
        raise UserInputError(
            f"{where}: language {language!r}; the code task runs {list(LANGUAGES)}"
        )
    tests = row.get("tests")
    if not isinstance(tests, list) or not tests:
        raise UserInputError(f"{where}: 'tests' must be a non-empty list")
    return [_test(test, f"{where} test {i}") for i, test in enumerate(tests)]


def _test(test: Any, where: str) -> CodeTest:
    if isinstance(test, dict) and set(test) == {"assert"} and isinstance(test["assert"], str):
        return CodeTest(check=test["assert"])
    if (
        isinstance(test, dict)
        and set(test) <= {"stdin", "stdout"}
        and isinstance(test.get("stdout"), str)
        and isinstance(test.get("stdin", ""), str)
    ):
        return CodeTest(stdin=test.get("stdin", ""), stdout=test["stdout"])
    raise UserInputError(f"{where}: expected {{stdin, stdout}} text or {{assert: code}}")


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
