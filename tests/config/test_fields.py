"""Bounds declared on config fields (`metadata` ge, gt, le, lt): the loader refuses a value
that breaks one, naming the full dotted key and where the value came from; `check_fields`
refuses the same in a config built in code. The cases are generated from the fields'
metadata of every command's config, so a new bounded field is covered as it is declared.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin

import pytest
import yaml

from dorarl.bench.convergence import ConvergenceConfig
from dorarl.bench.modes import ModesConfig
from dorarl.config import ConfigError, check_fields, load_config
from dorarl.config.fields import BOUNDS, bound_problem, declared_bounds, field_problem
from dorarl.config.loader import derived_keys
from dorarl.jobs.config import TrainConfig
from dorarl.simulate.config import SimulateConfig

ROOTS = [TrainConfig, SimulateConfig, ModesConfig, ConvergenceConfig]
"""The configs a command loads (dorarl train, simulate, bench modes, bench convergence)."""


def bounded_leaves(cls: type, prefix: str = "") -> list[tuple[str, type, dict[str, Any]]]:
    """(dotted key, scalar type, declared bounds) of every bounded leaf field under `cls`."""
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        ftype = hints[f.name]
        if dataclasses.is_dataclass(ftype):
            found += bounded_leaves(ftype, f"{prefix}{f.name}.")
        elif declared_bounds(f.metadata):
            if get_origin(ftype) in (typing.Union, types.UnionType):  # its bounded type
                (ftype,) = [a for a in get_args(ftype) if a in (int, float)]
            found.append((f"{prefix}{f.name}", ftype, declared_bounds(f.metadata)))
    return found


def breaking(ftype: type, bound: str, limit: float) -> int | float:
    """The nearest value of `ftype` that breaks `bound` at `limit`."""
    step = 1 if ftype is int else 0.5
    value = {"gt": limit, "ge": limit - step, "lt": limit, "le": limit + step}[bound]
    return int(value) if ftype is int else float(value)


def cases() -> list[tuple[type, str, str, Any]]:
    """(root, dotted key, bound, a value breaking it) for every bound of every root; keys a
    root derives from another (trainer.temperature) are no settings and are left out."""
    return [
        (root, key, bound, breaking(ftype, bound, limit))
        for root in ROOTS
        for key, ftype, bounds in bounded_leaves(root)
        if key not in derived_keys(root)
        for bound, limit in bounds.items()
    ]


def _id(case: tuple) -> str:
    root, key, bound, value = case
    return f"{root.__name__}:{key}:{bound}={value}"


def test_the_commands_declare_their_bounds():
    """Every simple bound of `dorarl train` is on its field (the cases below are made from
    them); a config whose bounds went back into hand-written checks would show fewer."""
    keys = {key for root, key, _, _ in cases() if root is TrainConfig}
    assert len(keys) >= 50, sorted(keys)
    assert {"ray.max_engine_restarts", "sampling.temperature", "engine.block_size"} <= keys
    assert len({key for root, key, _, _ in cases() if root is SimulateConfig}) >= 30


@pytest.mark.parametrize("case", cases(), ids=_id)
def test_the_loader_refuses_a_broken_bound_naming_the_full_key(case):
    root, key, _, value = case
    text = yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()
    with pytest.raises(ConfigError) as refused:
        load_config(root, None, [f"{key}={text}"])
    message = str(refused.value)
    assert message.startswith(f"{key}: must be "), message
    assert message.endswith(f", got {value} (command line)"), message


@pytest.mark.parametrize("case", cases(), ids=_id)
def test_a_config_built_in_code_is_held_to_the_same_bounds(case):
    root, key, _, value = case
    config = load_config(root)
    *sections, name = key.split(".")
    node = config
    for part in sections:
        node = getattr(node, part)
    setattr(node, name, value)
    assert field_problem(config).startswith(f"{key}: must be ")
    with pytest.raises(ConfigError, match=f"^{key}: must be "):
        check_fields(config)


@pytest.mark.parametrize("root", ROOTS, ids=lambda c: c.__name__)
def test_every_default_keeps_to_its_fields_bounds(root):
    assert field_problem(load_config(root)) is None


@pytest.mark.parametrize(
    ("metadata", "value", "problem"),
    [
        ({"ge": 0}, -1, "must be >= 0, got -1"),
        ({"gt": 0, "le": 1}, 1.5, "must be in (0, 1], got 1.5"),
        ({"ge": 0, "lt": 1}, 1.0, "must be in [0, 1), got 1.0"),
        ({"gt": 1e-4}, 0.0, "must be > 0.0001, got 0.0"),
        ({"ge": 0}, math.nan, "must be >= 0, got nan"),  # NaN keeps to no bound
        ({"ge": 0}, None, None),  # an unset optional
        ({"ge": 0}, 0, None),
        ({"help": "no bound"}, -1, None),
    ],
)
def test_bound_problems_read_as_the_bounds_are_written(metadata, value, problem):
    assert bound_problem(metadata, value) == problem
    assert set(BOUNDS) == {"ge", "gt", "le", "lt"}


@dataclass
class _Inner:
    share: float | None = field(default=None, metadata={"help": "a share", "gt": 0, "le": 1})


@dataclass
class _Root:
    """A config with bounds and no validate(): the loader alone holds it to them."""

    restarts: int = field(default=3, metadata={"help": "restarts", "ge": 0})
    mode: Literal["a", "b"] = "a"
    inner: _Inner = field(default_factory=_Inner)


def test_the_loader_names_the_key_and_where_the_value_came_from(tmp_path):
    with pytest.raises(ConfigError, match=r"^restarts: must be >= 0, got -1 \(command line\)$"):
        load_config(_Root, None, ["restarts=-1"])
    path = tmp_path / "run.yaml"
    path.write_text("inner:\n  share: 2\n")
    with pytest.raises(
        ConfigError, match=rf"^inner.share: must be in \(0, 1\], got 2.0 \({path}\)$"
    ):
        load_config(_Root, path)
    assert load_config(_Root, None, ["inner.share=1", "restarts=0"]).inner.share == 1.0


def test_check_fields_walks_the_sections_and_the_choices():
    check_fields(_Root())
    with pytest.raises(ConfigError, match=r"^inner.share: must be in \(0, 1\], got 0$"):
        check_fields(_Root(inner=_Inner(share=0)))
    with pytest.raises(ConfigError, match="^mode: must be one of 'a', 'b', got 'c'$"):
        check_fields(_Root(mode="c"))
    with pytest.raises(ConfigError, match="^engine.restarts: must be >= 0"):
        check_fields(_Root(restarts=-2), "engine.")
