"""A stop keeps what was sampled: after `Stop` nothing is dispatched and no step starts, the
requests in flight finish, and the complete groups left are carried whole into a resumed
controller, which queues them under their own versions (or drops what its window cannot
take)."""

from dorarl.controller import (
    CarriedGroup,
    Controller,
    ControllerConfig,
    Dispatch,
    DropGroup,
    Finish,
    SampleDone,
    SetTimer,
    Start,
    Stop,
    Timer,
    Train,
    TrainDone,
)
from dorarl.controller.invariants import violations


def _config(**overrides) -> ControllerConfig:
    base = dict(mode="dora", K=1, tbs=2, rbs=4, group_size=1, instances=2, slots=2, steps=6)
    return ControllerConfig(**(base | overrides))


def _of(kind, commands) -> list:
    return [c for c in commands if isinstance(c, kind)]


def _done(ctl: Controller, d: Dispatch, now: float) -> list:
    return ctl.handle(SampleDone(d.group_id, 0, d.instance_id, 4, now))


def test_a_stop_lets_the_requests_in_flight_finish_and_carries_the_complete_groups():
    ctl = Controller(_config())
    out = _of(Dispatch, ctl.handle(Start(0.0)))
    assert len(out) == 4
    commands = _done(ctl, out[0], 1.0) + _done(ctl, out[1], 1.5)
    (train,) = _of(Train, commands)  # step 0 on groups 0 and 1
    out += _of(Dispatch, commands)  # their slots refilled: 4 groups in flight
    assert ctl.handle(Stop(2.0, deadline=100.0)) == [SetTimer(100.0)]
    commands = _done(ctl, out[2], 3.0)
    assert not _of(Dispatch, commands) and not _of(Train, commands)  # nothing new
    assert not _of(Finish, ctl.handle(TrainDone(1, 4.0)))  # the step ends, requests run on
    for i, d in enumerate(out[3:]):
        commands = _done(ctl, d, 5.0 + i)
        assert not _of(Dispatch, commands) and not _of(Train, commands)
    assert _of(Finish, commands) and ctl.finished  # the last request in flight ended
    assert violations(ctl.ledger) == []
    queued = [d.group_id for d in out[2:]]
    state = ctl.resume_state(carry=True)
    assert state["version"] == 1 and state["carried_group_ids"] == queued
    assert state["resume_prompts"] == []  # every untrained prompt is in a carried group
    # without carry (a periodic checkpoint) their prompts come first, as before
    assert ctl.resume_state()["resume_prompts"] == [d.prompt_index for d in out[2:]]


def test_a_stop_past_its_deadline_leaves_the_requests_still_running():
    ctl = Controller(_config())
    out = _of(Dispatch, ctl.handle(Start(0.0)))
    ctl.handle(Stop(1.0, deadline=10.0))
    _done(ctl, out[0], 2.0)
    assert not ctl.finished and not _of(Finish, ctl.handle(Timer(5.0)))
    (finish,) = _of(Finish, ctl.handle(Timer(10.0)))
    assert "3 requests left in flight" in finish.reason
    assert ctl.resume_state(carry=True)["carried_group_ids"] == [out[0].group_id]


def test_a_resumed_controller_trains_the_carried_groups_under_their_own_versions():
    config = _config(initial_version=3, first_group=20, first_prompt=30)
    ctl = Controller(config)
    carried = (CarriedGroup(11, 7, 2), CarriedGroup(12, 8, 3), CarriedGroup(10, 6, 1))
    commands = ctl.handle(Start(0.0, carried))
    # v1 is outside the window of step 3 (K=1): dropped; v2 and v3 make a batch at once
    assert _of(DropGroup, commands) == [DropGroup(10, 1, "carried_beyond_staleness_K1")]
    assert _of(Train, commands) == [Train((11, 12), 3)]
    counts = ctl.counts()
    assert (counts["carried"], counts["consumed"], counts["queued"]) == (3 - 1, 2, 0)
    new = _of(Dispatch, commands)
    assert new and all(d.group_id >= 20 and d.version == 3 for d in new)
    assert violations(ctl.ledger) == []


def test_carried_groups_take_only_the_room_admission_leaves():
    ctl = Controller(_config(initial_version=3, tbs=1))
    # K=1, TBS=1 at t=3: v2 may hold 1 group, v2..v3 together 2
    carried = tuple(CarriedGroup(i, i, 2) for i in range(3))
    commands = ctl.handle(Start(0.0, carried))
    assert [c.group_id for c in _of(DropGroup, commands)] == [1, 2]
    assert _of(Train, commands) == [Train((0,), 3)]
    assert violations(ctl.ledger) == []
