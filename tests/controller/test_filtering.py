"""Dynamic sampling (rollout.filter_groups) on scripted event sequences: a complete group of
equal rewards is filtered, leaves the outstanding count (so more prompts go out and no step
waits for it), is never trained, and the per-version budget falls back to training on it."""

import pytest

from dorarl.config import ConfigError
from dorarl.controller import (
    Controller,
    ControllerConfig,
    Dispatch,
    FilterGroup,
    RolloutConfig,
    SampleDone,
    Start,
    Train,
    TrainDone,
)
from dorarl.controller.invariants import violations


def only(commands, kind):
    return [c for c in commands if isinstance(c, kind)]


def config(mode="dora", cap=64, **overrides):
    base = dict(mode=mode, K=1, tbs=2, rbs=2, group_size=2, instances=1, slots=4, steps=3,
                rollout=RolloutConfig(filter_groups=True, max_filtered_per_step=cap))  # fmt: skip
    return ControllerConfig(**(base | overrides))


def finish(ctl, dispatches, group_id, rewards, now=1.0):
    """Every sample of `group_id` finishes with `rewards` (by sample index)."""
    out = []
    for d in dispatches:
        if d.group_id == group_id:
            for s in d.sample_indices:
                out += ctl.handle(SampleDone(group_id, s, d.instance_id, 5, now, rewards[s]))
    return out


@pytest.mark.parametrize("mode", ["dora", "sync", "one_step_off", "partial_rollout"])
def test_a_uniform_group_is_filtered_and_a_new_prompt_takes_its_place(mode):
    ctl = Controller(config(mode))
    dispatches = only(ctl.handle(Start(0.0)), Dispatch)
    assert sorted({d.group_id for d in dispatches}) == [0, 1]
    commands = finish(ctl, dispatches, 0, [1.0, 1.0])  # all correct: zero advantage
    assert only(commands, FilterGroup) == [FilterGroup(0, 0, 0)]
    assert not only(commands, Train)
    refill = only(commands, Dispatch)
    assert {d.group_id for d in refill} == {2} and refill[0].version == 0
    assert commands.index(only(commands, FilterGroup)[0]) < commands.index(refill[0])
    assert ctl.counts()["filtered"] == 1 and ctl.counts()["queued"] == 0
    assert violations(ctl.ledger) == []
    finish(ctl, dispatches, 1, [0.0, 1.0])
    commands = finish(ctl, refill, 2, [1.0, 0.0])
    assert only(commands, Train) == [Train((1, 2), 0)]  # TBS informative groups, 0 left out
    assert violations(ctl.ledger) == []


def test_filtering_off_trains_uniform_groups_as_before():
    ctl = Controller(config(rollout=RolloutConfig()))
    dispatches = only(ctl.handle(Start(0.0)), Dispatch)
    finish(ctl, dispatches, 0, [1.0, 1.0])
    commands = finish(ctl, dispatches, 1, [0.0, 0.0])
    assert not only(commands, FilterGroup)
    assert only(commands, Train) == [Train((0, 1), 0)]


def test_the_budget_falls_back_to_training_uniform_groups_and_resets_each_version():
    ctl = Controller(config(cap=1, rbs=4, K=1, steps=3, slots=8))
    dispatches = only(ctl.handle(Start(0.0)), Dispatch)
    assert len({d.group_id for d in dispatches}) == 4
    assert only(finish(ctl, dispatches, 0, [0.0, 0.0]), FilterGroup) == [FilterGroup(0, 0, 0)]
    # the budget of version 0 is spent: the next uniform group is queued and trained
    assert not only(finish(ctl, dispatches, 1, [0.0, 0.0]), FilterGroup)
    commands = finish(ctl, dispatches, 2, [1.0, 0.0])
    (train,) = only(commands, Train)
    assert train == Train((1, 2), 0)
    ctl.handle(TrainDone(1, 2.0))  # version 1 is the newest: a fresh budget
    commands = finish(ctl, dispatches, 3, [1.0, 1.0], now=3.0)
    assert only(commands, FilterGroup) == [FilterGroup(3, 0, 1)]
    assert ctl.counts()["filtered"] == 2 and violations(ctl.ledger) == []


def test_a_filtered_group_frees_the_need_of_the_oldest_version():
    # K=1, TBS=2: at step 1, version 0's stragglers must all go in; filtering one of them
    # removes it from the need instead of holding the step for it
    ctl = Controller(config(rbs=4, K=1, steps=3, instances=2))
    dispatches = only(ctl.handle(Start(0.0)), Dispatch)
    finish(ctl, dispatches, 0, [1.0, 0.0])
    (train,) = only(finish(ctl, dispatches, 1, [0.0, 1.0]), Train)
    assert train.group_ids == (0, 1)
    ctl.handle(TrainDone(1, 2.0))
    finish(ctl, dispatches, 2, [0.0, 1.0], now=3.0)
    assert ctl.ledger.out_counts()[0] == 2  # groups 2 and 3 of v0, both needed by step 1
    commands = finish(ctl, dispatches, 3, [0.0, 0.0], now=4.0)  # the straggler is uniform
    assert only(commands, FilterGroup) == [FilterGroup(3, 0, 1)]
    assert ctl.ledger.out_counts().get(0) == 1
    assert violations(ctl.ledger) == []


def test_a_filtered_prompt_is_not_dispatched_again_on_resume():
    ctl = Controller(config(rbs=2))
    dispatches = only(ctl.handle(Start(0.0)), Dispatch)
    finish(ctl, dispatches, 0, [1.0, 1.0])
    untrained = ctl.resume_state()["resume_prompts"]
    assert 0 not in untrained and 1 in untrained  # group 0 ended (filtered), group 1 did not


def test_a_late_report_of_a_filtered_group_changes_nothing():
    ctl = Controller(config())
    dispatches = only(ctl.handle(Start(0.0)), Dispatch)
    finish(ctl, dispatches, 0, [1.0, 1.0])
    before = ctl.counts()
    assert ctl.handle(SampleDone(0, 1, 0, 5, 2.0, 1.0)) == []
    assert ctl.counts() == before and violations(ctl.ledger) == []


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"group_size": 1}, "rollout.filter_groups"),
        ({"rollout": RolloutConfig(filter_groups=True, max_filtered_per_step=0)},
         "rollout.max_filtered_per_step"),
        ({"max_groups": 3 * (2 + 63)}, "max_groups"),  # 3 steps x (tbs + 64) needed
    ],
)  # fmt: skip
def test_config_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=f"^{key}:"):
        config(**overrides).validate()
    config(max_groups=3 * (2 + 64)).validate()
