"""Held-out splits of generated problems: distinct evaluation problems drawn first, then
training problems that never repeat one of them."""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable
from typing import Protocol, TypeVar


class Keyed(Protocol):
    def key(self) -> Hashable: ...


P = TypeVar("P", bound=Keyed)


def draw_held_out(draw: Callable[[random.Random], P], rng: random.Random, n: int) -> list[P]:
    """`n` problems of distinct keys (the caller checks that `n` of them exist)."""
    problems: dict[Hashable, P] = {}
    while len(problems) < n:
        problem = draw(rng)
        problems.setdefault(problem.key(), problem)
    return list(problems.values())


def draw_training(
    draw: Callable[[random.Random], P], rng: random.Random, n: int, held_out: list[P]
) -> list[P]:
    """`n` problems, repeats allowed, none with the key of a held-out one."""
    excluded = {p.key() for p in held_out}
    problems: list[P] = []
    while len(problems) < n:
        problem = draw(rng)
        if problem.key() not in excluded:
            problems.append(problem)
    return problems
