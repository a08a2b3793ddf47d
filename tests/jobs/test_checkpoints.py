"""A run's checkpoints: which versions get one (checkpoint_every: N, 0 for the end only, off
for none), the key's spellings, and how long the run's end waits for the writes."""

from __future__ import annotations

import time

import pytest

from dorarl.config import ConfigError, load_config
from dorarl.jobs.checkpoints import Checkpoints
from dorarl.jobs.config import TrainConfig


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


@pytest.mark.slow
def test_the_end_waits_for_checkpoint_writes_at_most_checkpoint_timeout_s(tmp_path):
    """A trainer hung in a write fails the run in one line naming what was not written,
    instead of the run's end waiting forever."""
    import ray

    from dorarl.errors import RunFailed
    from dorarl.runtime.local_ray import start_local_ray

    def write(seconds: float) -> None:  # a write the trainer never finishes in time
        time.sleep(seconds)

    start_local_ray(num_cpus=1)
    try:
        config = load_config(TrainConfig, None, ["checkpoint_every=2", "checkpoint_timeout_s=2"])
        checkpoints = Checkpoints.of(config, tmp_path)
        checkpoints.pending.append(ray.remote(num_cpus=0)(write).remote(60))
        started = time.monotonic()
        with pytest.raises(RunFailed, match=r"^checkpoint of 1 periodic write\(s\) not written "
                           r"after 2s \(checkpoint_timeout_s\); none was written$"):  # fmt: skip
            checkpoints.report(wait=True)
        assert time.monotonic() - started < 10
    finally:
        ray.shutdown()
