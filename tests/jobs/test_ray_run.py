"""A run's checkpoints: which versions get one (checkpoint_every: N, 0 for the end only, off
for none), and the key's spellings."""

from __future__ import annotations

import pytest

from dorarl.config import ConfigError, load_config
from dorarl.jobs.config import TrainConfig
from dorarl.jobs.ray_run import Checkpoints


def _due(every, steps: int = 60, stopping: bool = False) -> list[int]:
    checkpoints = Checkpoints.of(
        load_config(TrainConfig, None, [f"checkpoint_every={every}", f"steps={steps}"]), None
    )
    return [v for v in range(1, steps + 1) if checkpoints.periodic_due(v, stopping)]


def test_periodic_checkpoints_leave_the_end_to_the_final_one():
    assert _due(20) == [20, 40]  # 60 is the end's
    assert _due(20, stopping=True) == []  # a stop's version is saved once, at the end
    assert _due(0) == [] and not Checkpoints.of(load_config(TrainConfig), None).off


def test_off_writes_no_checkpoint_at_all():
    config = load_config(TrainConfig, None, ["checkpoint_every=off"])
    assert config.checkpoint_every == "off" and Checkpoints.of(config, None).off
    assert _due("off") == []


@pytest.mark.parametrize(
    ("value", "problem"),
    [("of", "expected int or 'off', got 'of'"), ("-1", "must be >= 0, got -1")],
)
def test_checkpoint_every_is_a_count_or_off(value, problem):
    with pytest.raises(ConfigError, match=rf"^checkpoint_every: {problem} \(command line\)$"):
        load_config(TrainConfig, None, [f"checkpoint_every={value}"])
