"""Bounds declared on config fields (`metadata` ge, gt, le, lt): the loader refuses a value
that breaks one, naming the full dotted key and where the value came from; `check_fields`
refuses the same in a config built in code."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import pytest

from dorarl.config import ConfigError, check_fields, load_config
from dorarl.config.fields import BOUNDS, bound_problem


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
