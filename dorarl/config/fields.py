"""What a config field declares about its values: the choices of its `Literal` type and the
bounds in its metadata, e.g. `field(default=3, metadata={"help": ..., "ge": 0})` (ge, gt,
le, lt).

The loader checks each value it reads against them (`dorarl.config.loader`); `check_fields`
checks a config built in code, its sections included, naming each key in full. A None value
is an unset optional: no bound applies to it. NaN breaks every bound.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, get_args, get_origin

from dorarl.config.errors import ConfigError

BOUNDS: dict[str, tuple[Callable[[Any, Any], bool], str]] = {
    "gt": (operator.gt, ">"),
    "ge": (operator.ge, ">="),
    "lt": (operator.lt, "<"),
    "le": (operator.le, "<="),
}


def declared_bounds(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """{bound name: limit} of the bounds a field declares (none: {})."""
    return {name: metadata[name] for name in BOUNDS if name in metadata}


def bound_problem(metadata: Mapping[str, Any], value: Any) -> str | None:
    """Why `value` breaks the bounds `metadata` declares ("must be >= 0, got -1"), or None.
    Bounds are on numbers: a word a field also takes (`checkpoint_every=off`) has none."""
    bounds = declared_bounds(metadata)
    if not _is_number(value) or all(
        BOUNDS[name][0](value, limit) for name, limit in bounds.items()
    ):
        return None
    return f"must be {_wanted(bounds)}, got {value}"


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _wanted(bounds: dict[str, Any]) -> str:
    """`>= 0`, or an interval `(0, 1]` for a lower and an upper bound."""
    low = next((name for name in ("gt", "ge") if name in bounds), None)
    high = next((name for name in ("lt", "le") if name in bounds), None)
    if low and high:
        opened, closed = "(" if low == "gt" else "[", ")" if high == "lt" else "]"
        return f"in {opened}{bounds[low]:g}, {bounds[high]:g}{closed}"
    return " and ".join(f"{BOUNDS[name][1]} {limit:g}" for name, limit in bounds.items())


def choice_problem(ftype: Any, value: Any) -> str | None:
    """Why `value` is none of the choices a `Literal` type (or an optional one) allows, or
    None (any other type: no choices). In a union with a plain type (`int | Literal["off"]`)
    a value of that type is no choice to check."""
    if get_origin(ftype) in (typing.Union, types.UnionType):
        options = get_args(ftype)
        if value is None and type(None) in options:
            return None
        plain = [a for a in options if isinstance(a, type) and a is not type(None)]
        if any(type(value) is a or (a is float and type(value) is int) for a in plain):
            return None
        literals = [a for a in options if get_origin(a) is Literal]
        return choice_problem(literals[0], value) if len(literals) == 1 else None
    if get_origin(ftype) is not Literal or value in get_args(ftype):
        return None
    choices = ", ".join(repr(choice) for choice in get_args(ftype))
    return f"must be one of {choices}, got {value!r}"


def field_problem(config: Any, prefix: str = "") -> str | None:
    """The first field of `config` (a dataclass; its sections' fields too) whose value breaks
    what the field declares, as "dotted.key: reason"; None when every value keeps to it."""
    hints = _hints(type(config))
    for f in dataclasses.fields(config):
        key, value = f"{prefix}{f.name}", getattr(config, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            problem = field_problem(value, f"{key}.")
        else:
            reason = choice_problem(hints[f.name], value) or bound_problem(f.metadata, value)
            problem = reason and f"{key}: {reason}"
        if problem:
            return problem
    return None


def check_fields(config: Any, prefix: str = "") -> None:
    """Raise ConfigError("dotted.key: reason") for the first value of `config` that breaks
    what its field declares: for a config built in code, which no loader checked."""
    problem = field_problem(config, prefix)
    if problem:
        raise ConfigError(problem)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)
