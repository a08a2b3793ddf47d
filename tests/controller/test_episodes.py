"""Scripted multi-turn episodes against the controller: a waiting episode frees its decode
slot, not its place, and an instance never holds more than its bound."""

import pytest

from dorarl.config import ConfigError
from dorarl.controller import (
    Controller,
    ControllerConfig,
    Dispatch,
    EnvAnswered,
    EnvWaiting,
    LoadWeights,
    Migrate,
    MigrationDone,
    OrchestratorConfig,
    SampleDone,
    Start,
    Train,
    TrainDone,
)
from dorarl.controller.invariants import violations


def only(commands, kind):
    return [c for c in commands if isinstance(c, kind)]


def config(overcommit: float = 2.0, **fields) -> ControllerConfig:
    base = dict(mode="dora", K=3, tbs=2, rbs=8, group_size=1, instances=1, slots=2, steps=3)
    base.update(fields)
    return ControllerConfig(**base, orchestrator=OrchestratorConfig(episode_overcommit=overcommit))


class Script:
    """Delivers events, checks the ledger after each, keeps the Dispatches seen."""

    def __init__(self, cfg: ControllerConfig) -> None:
        self.ctl = Controller(cfg)
        self.dispatched: list[Dispatch] = []

    def send(self, event) -> list:
        commands = self.ctl.handle(event)
        self.dispatched += only(commands, Dispatch)
        assert violations(self.ctl.ledger) == []
        return commands

    def held(self, instance_id: int = 0) -> int:
        return len(self.ctl.instance(instance_id).requests)


def test_a_waiting_episode_frees_its_slot_for_a_new_group_up_to_the_bound():
    run = Script(config())
    assert len(only(run.send(Start()), Dispatch)) == 2  # both slots
    # Both episodes wait for their environment: their slots take two new groups (with the
    # old accounting a waiting episode kept its slot, and nothing was dispatched here).
    assert only(run.send(EnvWaiting(0, 0, 1.0)), Dispatch) == [Dispatch(2, 2, 0, 0, (0,))]
    assert only(run.send(EnvWaiting(1, 0, 1.1)), Dispatch) == [Dispatch(3, 3, 0, 0, (0,))]
    # Four held, the bound (2 x 2 slots): waiting episodes free no more room.
    assert run.send(EnvWaiting(2, 0, 1.2)) == [] and run.send(EnvWaiting(3, 0, 1.3)) == []
    assert run.held() == 4
    # Answered: it runs again; finished straight from waiting: its place is free.
    assert run.send(EnvAnswered(0, 0, 2.0)) == []
    assert only(run.send(SampleDone(1, 0, 0, 5, 2.1)), Dispatch) == [Dispatch(4, 4, 0, 0, (0,))]
    assert run.held() == 4


def test_reports_about_finished_or_unchanged_episodes_change_nothing():
    run = Script(config())
    run.send(Start())
    run.send(EnvWaiting(0, 0, 1.0))
    before = run.ctl.ledger.free[0]
    assert run.send(EnvWaiting(0, 0, 1.1)) == []  # repeated
    assert run.send(EnvAnswered(9, 0, 1.2)) == []  # never dispatched
    assert run.ctl.ledger.free[0] == before
    run.send(SampleDone(0, 0, 0, 5, 1.3))
    assert run.send(EnvAnswered(0, 0, 1.4)) == []  # done already
    assert run.ctl.ledger.instances[0].waiting == 0


def test_an_overcommit_of_one_keeps_a_waiting_episode_on_its_slot():
    run = Script(config(overcommit=1.0))
    run.send(Start())
    assert run.send(EnvWaiting(0, 0, 1.0)) == []
    assert run.send(EnvWaiting(1, 0, 1.1)) == [] and run.held() == 2


def test_a_legacy_version_of_waiting_episodes_packs_onto_fewer_instances():
    """At the publish, v0's episodes all wait for their environment: they need no decode slot,
    so v0 keeps one instance (its waiting episodes moved there, still waiting) and the other
    takes v1. Counted by slots, v0 would keep both and v1 get none until they finish."""
    run = Script(config(K=1, tbs=4, rbs=8, instances=2))
    assert len(only(run.send(Start()), Dispatch)) == 4
    for gid in range(4):
        run.send(EnvWaiting(gid, 0, 1.0))
    assert len(run.dispatched) == 8  # four more on the freed slots
    commands = []
    for gid in range(4, 8):
        commands += run.send(SampleDone(gid, 0, run.dispatched[gid].instance_id, 5, 2.0))
    assert only(commands, Train) == [Train((4, 5, 6, 7), 0)]
    commands = run.send(TrainDone(1, 3.0))
    (migrate,) = only(commands, Migrate)
    assert len(migrate.request_ids) == 2
    assert only(commands, LoadWeights) == [LoadWeights(migrate.src, 1, -1)]
    run.send(MigrationDone(migrate.request_ids, migrate.src, migrate.dst, 3.5))
    kept = run.ctl.ledger.instances[migrate.dst]
    assert len(kept.requests) == kept.waiting == 4  # still waiting, on their version
    assert run.ctl.instance(migrate.dst).version == 0


@pytest.mark.parametrize("bad", [0.5, 0.0, float("inf"), float("nan")])
def test_the_overcommit_is_validated_by_its_full_key(bad):
    with pytest.raises(ConfigError, match=r"^orchestrator\.episode_overcommit:"):
        config(overcommit=bad).validate()


def test_the_bound_is_never_under_the_slots():
    assert config(overcommit=1.0).max_held == 2
    assert config(overcommit=1.4).max_held == 2  # 2.8 requests round down, never below slots
    assert config(overcommit=2.5, slots=3).max_held == 7


def test_an_answered_episode_beyond_the_slots_takes_nothing_new_until_one_ends():
    """Four held on two slots, all four running again (environments answered at once): the
    engine queues two; the controller dispatches nothing until three have ended."""
    run = Script(config())
    run.send(Start())
    for gid in range(2):
        run.send(EnvWaiting(gid, 0, 1.0))
    for gid in range(4):
        run.send(EnvWaiting(gid, 0, 1.5))
    for gid in range(4):
        assert run.send(EnvAnswered(gid, 0, 2.0)) == []
    assert run.ctl.ledger.free_slots(run.ctl.ledger.instances[0]) == 0
    assert only(run.send(SampleDone(0, 0, 0, 5, 2.1)), Dispatch) == []  # 3 running, 2 slots
    assert only(run.send(SampleDone(1, 0, 0, 5, 2.2)), Dispatch) == []  # 2 running
    assert len(only(run.send(SampleDone(2, 0, 0, 5, 2.3)), Dispatch)) == 1
