"""`Problems` gathers the user errors of every check and raises them once: one as itself,
several as one error whose message is a line per problem, caught as either kind."""

from __future__ import annotations

import pytest

from dorarl.config import ConfigError, ManyProblems, Problems
from dorarl.errors import UserInputError


def _refuse(message: str, kind: type[ValueError] = ConfigError) -> None:
    raise kind(message)


def test_one_problem_is_raised_as_itself():
    problems = Problems()
    problems.check(_refuse, "task.path: no such data file x", UserInputError)
    assert problems.check(len, "ok") == 2  # a check that passes gives its result
    with pytest.raises(UserInputError, match="^task.path: no such data file x$") as raised:
        problems.raise_any()
    assert type(raised.value) is UserInputError


def test_several_problems_are_one_error_a_line_each():
    problems = Problems()
    problems.check(_refuse, "K: must be >= 0")
    with problems.collecting():
        _refuse("task.reward: unknown reward 'x'", UserInputError)
    problems.check(_refuse, "K: must be >= 0")  # the same line twice: said once
    for kind in (ConfigError, UserInputError):
        with pytest.raises(kind) as raised:
            problems.raise_any()
        assert isinstance(raised.value, ManyProblems)
        assert str(raised.value).splitlines() == [
            "K: must be >= 0",
            "task.reward: unknown reward 'x'",
        ]


def test_no_problem_raises_nothing_and_other_errors_pass_through():
    problems = Problems()
    problems.raise_any()
    with pytest.raises(KeyError):
        problems.check(_refuse, "not a user error", KeyError)
