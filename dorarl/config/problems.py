"""`Problems`: the user errors every check found, gathered so that one error reports them all,
one line each (the CLI prints each line, exit 2)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from dorarl.config.errors import ConfigError
from dorarl.errors import UserInputError

T = TypeVar("T")


class ManyProblems(ConfigError, UserInputError):
    """Several user errors at once; its message is one line per problem. Both a ConfigError
    and a UserInputError, so a caller that catches either kind catches it."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


class Problems:
    """Collects the ConfigErrors and UserInputErrors of the checks it runs (`check`, or a
    block: `collecting`), then raises them together (`raise_any`): one alone as itself, several as `ManyProblems`."""

    def __init__(self) -> None:
        self.errors: list[ValueError] = []

    def __len__(self) -> int:
        return len(self.errors)

    @property
    def lines(self) -> list[str]:
        return [line for error in self.errors for line in str(error).splitlines()]

    def add(self, error: ValueError) -> None:
        self.errors.append(error)

    def check(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """`fn(*args, **kwargs)`, or None with its user error collected."""
        try:
            return fn(*args, **kwargs)
        except (ConfigError, UserInputError) as exc:
            self.add(exc)
            return None

    @contextmanager
    def collecting(self) -> Iterator[None]:
        """The block's user error collected, not raised (the block ends there)."""
        try:
            yield
        except (ConfigError, UserInputError) as exc:
            self.add(exc)

    def raise_any(self) -> None:
        if len(self.errors) == 1:
            raise self.errors[0]
        if self.errors:
            raise ManyProblems(list(dict.fromkeys(self.lines)))
