"""Resuming from a checkpoint: the controller starts at the checkpoint's version, dispatches
the prompts that were never trained on first, and reports the data position to save."""

import pytest

from dorarl.config import ConfigError
from dorarl.controller import (
    Controller,
    ControllerConfig,
    Dispatch,
    Finish,
    SampleDone,
    Start,
    Train,
    TrainDone,
)
from dorarl.controller.invariants import violations


def _config(**overrides) -> ControllerConfig:
    base = dict(mode="dora", K=1, tbs=2, rbs=3, group_size=1, instances=2,
                slots=2, steps=7, initial_version=5, first_group=10,
                first_prompt=20, resume_prompts=[3, 4])  # fmt: skip
    return ControllerConfig(**(base | overrides))


def _dispatches(commands) -> list[Dispatch]:
    return [c for c in commands if isinstance(c, Dispatch)]


def _done(ctl: Controller, d: Dispatch, now: float) -> list:
    return ctl.handle(SampleDone(d.group_id, 0, d.instance_id, 4, now))


def test_a_resumed_run_starts_at_its_version_with_the_untrained_prompts_first():
    ctl = Controller(_config())
    first = _dispatches(ctl.handle(Start(0.0)))
    assert [(d.group_id, d.prompt_index, d.version) for d in first] == [
        (10, 3, 5), (11, 4, 5), (12, 20, 5)
    ]  # fmt: skip
    assert ctl.instance_versions() == {0: 5, 1: 5}
    # nothing trained yet: a checkpoint now would resume with all three prompts first
    assert ctl.resume_state() == {"version": 5, "first_group": 13, "first_prompt": 21,
                                  "resume_prompts": [3, 4, 20]}  # fmt: skip
    _done(ctl, first[0], 1.0)
    commands = _done(ctl, first[2], 2.0)
    assert [c for c in commands if isinstance(c, Train)] == [Train((10, 12), 5)]
    # step 5 has finished, its TrainDone not yet delivered: the checkpoint of version 6
    # holds groups 10 and 12; prompt 4 (group 11) and whatever went out since are untrained
    state = ctl.resume_state()
    assert state["version"] == 6 and state["resume_prompts"][0] == 4
    assert 3 not in state["resume_prompts"] and 20 not in state["resume_prompts"]
    ctl.handle(TrainDone(6, 3.0))
    assert ctl.version == 6 and violations(ctl.ledger) == []


def test_the_run_finishes_at_steps_counted_from_version_zero():
    ctl = Controller(_config(steps=6, resume_prompts=[]))
    groups = _dispatches(ctl.handle(Start(0.0)))
    commands = []
    for i, d in enumerate(groups[:2]):
        commands += _done(ctl, d, 1.0 + i)
    (train,) = [c for c in commands if isinstance(c, Train)]
    assert train.version == 5
    assert any(isinstance(c, Finish) for c in ctl.handle(TrainDone(6, 3.0)))
    assert ctl.counts()["steps_done"] == 1 and ctl.counts()["steps_started"] == 1


@pytest.mark.parametrize(
    ("overrides", "key"),
    [({"initial_version": -1}, "initial_version"), ({"steps": 5}, "steps"),
     ({"first_prompt": -2}, "first_prompt"), ({"resume_prompts": [1, -1]}, "resume_prompts"),
     ({"max_groups": 3}, "max_groups")],
)  # fmt: skip
def test_resume_keys_are_validated(overrides, key):
    with pytest.raises(ConfigError, match=f"^{key}:"):
        _config(**overrides).validate()
