"""Scripted event sequences against the sans-IO controller: what it must answer, exactly."""

import pytest

from dorarl.config import ConfigError
from dorarl.controller import (
    TRAINER,
    Controller,
    ControllerConfig,
    Dispatch,
    Finish,
    InstanceStats,
    Interrupt,
    LoadWeights,
    Migrate,
    MigrationDone,
    Offload,
    OrchestratorConfig,
    ReleaseVersion,
    Resume,
    SampleDone,
    SetTimer,
    Start,
    Timer,
    Train,
    TrainDone,
    WeightsLoaded,
    parse_request_id,
)
from dorarl.controller.invariants import violations


def only(commands, kind):
    return [c for c in commands if isinstance(c, kind)]


def finish_group(ctl, dispatches, group_id, now):
    out = []
    for d in dispatches:
        if d.group_id == group_id:
            for s in d.sample_indices:
                out += ctl.handle(SampleDone(group_id, s, d.instance_id, 10, now))
    return out


def test_sync_step_dispatch_wait_train_broadcast_redispatch():
    cfg = ControllerConfig(mode="sync", tbs=2, group_size=2, instances=3, slots=4, steps=2)
    ctl = Controller(cfg)
    first = ctl.handle(Start(0.0))
    dispatches = only(first, Dispatch)
    assert {d.group_id for d in dispatches} == {0, 1} and all(d.version == 0 for d in dispatches)
    assert finish_group(ctl, dispatches, 0, 1.0) == []  # the trainer waits for the whole batch
    commands = finish_group(ctl, dispatches, 1, 2.0)
    assert only(commands, Train) == [Train((0, 1), 0)]
    assert not only(commands, Dispatch)  # K=0: nothing new while the trainer runs
    commands = ctl.handle(TrainDone(1, 3.0))
    loads = only(commands, LoadWeights)
    assert loads == [LoadWeights(0, 1, TRAINER)]  # one from the trainer, the rest wait for a peer
    commands = ctl.handle(WeightsLoaded(0, 1, 4.0))
    # the new holder serves one peer and the freed trainer serves the other
    assert set(only(commands, LoadWeights)) == {LoadWeights(1, 1, 0), LoadWeights(2, 1, TRAINER)}
    assert not only(commands, Dispatch)  # lockstep: wait for every instance
    ctl.handle(WeightsLoaded(1, 1, 5.0))
    commands = ctl.handle(WeightsLoaded(2, 1, 5.5))
    assert {d.version for d in only(commands, Dispatch)} == {1}
    assert violations(ctl.ledger) == []


def test_one_step_off_generates_next_batch_under_old_version_during_training():
    cfg = ControllerConfig(
        mode="one_step_off",
        tbs=1,
        group_size=1,
        instances=1,
        slots=2,
        steps=3,
    )
    ctl = Controller(cfg)
    (d0,) = only(ctl.handle(Start()), Dispatch)
    commands = ctl.handle(SampleDone(d0.group_id, 0, 0, 5, 1.0))
    assert only(commands, Train) == [Train((0,), 0)]
    (d1,) = only(commands, Dispatch)
    assert d1.version == 0  # batch 1 under v0 overlaps step 0
    commands = ctl.handle(TrainDone(1, 2.0))
    assert not only(commands, LoadWeights)  # batch 1 still running: switch later, together
    commands = ctl.handle(SampleDone(d1.group_id, 0, 0, 5, 3.0))
    assert only(commands, Train) == [Train((1,), 1)]  # staleness 1
    assert only(commands, LoadWeights) == [LoadWeights(0, 1, TRAINER)]


def test_dora_consolidates_stragglers_and_promotes_the_freed_instance():
    cfg = ControllerConfig(
        mode="dora",
        K=1,
        rbs=4,
        tbs=2,
        group_size=1,
        instances=2,
        slots=4,
        steps=5,
    )
    ctl = Controller(cfg)
    start = ctl.handle(Start())
    assert start[0] == SetTimer(cfg.orchestrator.rebalance_period_s)
    dispatches = only(start, Dispatch)
    assert len(dispatches) == 4 and {d.instance_id for d in dispatches} == {0, 1}
    on = {d.group_id: d.instance_id for d in dispatches}
    # groups 0 and 2 finish: one per instance would be a coincidence, so pick by placement
    by_inst = {i: [g for g, j in on.items() if j == i] for i in (0, 1)}
    done = [by_inst[0][0], by_inst[1][0]]
    commands = []
    for g in done:
        commands += ctl.handle(SampleDone(g, 0, on[g], 10, 1.0))
    (train,) = only(commands, Train)
    assert sorted(train.group_ids) == sorted(done)
    # step 0 runs: new groups under v0 fill the free slots (admission: K x TBS = 2 more)
    commands = ctl.handle(TrainDone(1, 2.0))
    migrations = only(commands, Migrate)
    loads = only(commands, LoadWeights)
    # two stragglers of v0 fit on one instance: the other moves its request and takes v1
    assert len(loads) == 1 and loads[0].version == 1 and loads[0].source == TRAINER
    released = loads[0].instance_id
    assert all(m.src == released and m.dst != released for m in migrations)
    assert commands.index(migrations[-1]) < commands.index(loads[0]) if migrations else True
    assert violations(ctl.ledger) == []
    # a moved request may finish before its MigrationDone arrives: tolerated
    if migrations:
        g, s = parse_request_id(migrations[0].request_ids[0])
        ctl.handle(SampleDone(g, s, released, 12, 2.5))
        ctl.handle(MigrationDone((), migrations[0].src, migrations[0].dst, 2.6))
        assert ctl.ledger.instances[migrations[0].dst].incoming == 0
    assert violations(ctl.ledger) == []


def test_with_two_versions_an_instance_takes_the_new_one_and_its_stragglers_finish_there():
    """One instance, K=1, two versions held: at the publish of v1 it loads v1 at once (no
    migration, nothing waits for the stragglers), new groups go to v1 beside the v0
    stragglers, and v0 is released when its last request there ends."""
    cfg = ControllerConfig(
        mode="dora", K=1, rbs=3, tbs=1, group_size=1, instances=1, slots=4, steps=3,
        versions_per_instance=2,
    )  # fmt: skip
    ctl = Controller(cfg)
    dispatches = only(ctl.handle(Start()), Dispatch)
    assert [d.version for d in dispatches] == [0, 0]  # admission: (K+1) x TBS
    first, straggler = dispatches
    assert only(ctl.handle(SampleDone(first.group_id, 0, 0, 5, 1.0)), Train) == [Train((0,), 0)]
    commands = ctl.handle(TrainDone(1, 2.0))
    assert only(commands, LoadWeights) == [LoadWeights(0, 1, TRAINER)]
    assert not only(commands, Migrate) and not only(commands, ReleaseVersion)
    assert ctl.instance(0).held == (0,) and violations(ctl.ledger) == []
    commands = ctl.handle(WeightsLoaded(0, 1, 2.5))
    assert [d.version for d in only(commands, Dispatch)] == [1]  # beside the v0 straggler
    # the straggler ends: the trainer takes it (staleness 1) and v0 leaves the instance
    commands = ctl.handle(SampleDone(straggler.group_id, 0, 0, 50, 3.0))
    assert commands[0] == ReleaseVersion(0, 0)
    assert only(commands, Train) == [Train((straggler.group_id,), 1)]
    assert ctl.instance(0).held == () and violations(ctl.ledger) == []


def test_an_instance_with_no_request_of_its_old_version_releases_it_before_the_load():
    cfg = ControllerConfig(
        mode="dora", K=1, rbs=1, tbs=1, group_size=1, instances=1, slots=2, steps=3,
        versions_per_instance=2,
    )  # fmt: skip
    ctl = Controller(cfg)
    (d,) = only(ctl.handle(Start()), Dispatch)
    (again,) = only(ctl.handle(SampleDone(d.group_id, 0, 0, 5, 1.0)), Dispatch)  # during step 0
    ctl.handle(SampleDone(again.group_id, 0, 0, 5, 1.5))
    commands = ctl.handle(TrainDone(1, 2.0))
    assert commands[:2] == [ReleaseVersion(0, 0), LoadWeights(0, 1, TRAINER)]


def test_partial_rollout_interrupts_everything_and_resumes_after_the_load():
    cfg = ControllerConfig(
        mode="partial_rollout",
        K=1,
        rbs=2,
        tbs=1,
        group_size=2,
        instances=1,
        slots=4,
        steps=3,
    )
    ctl = Controller(cfg)
    dispatches = only(ctl.handle(Start()), Dispatch)
    assert [d.group_id for d in dispatches] == [0, 1]
    commands = finish_group(ctl, dispatches, 0, 1.0)
    assert only(commands, Train) == [Train((0,), 0)]
    commands = ctl.handle(TrainDone(1, 2.0))
    (interrupt,) = only(commands, Interrupt)
    assert set(interrupt.request_ids) == {"1:0", "1:1"}
    assert commands.index(interrupt) < commands.index(only(commands, LoadWeights)[0])
    commands = ctl.handle(WeightsLoaded(0, 1, 3.0))
    assert only(commands, Resume) == [Resume(interrupt.request_ids, 0, 1)]


def test_kv_pressure_offloads_youngest_in_lockstep_and_migrates_in_dora():
    sync = Controller(ControllerConfig(mode="sync", tbs=1, group_size=3, instances=1, slots=4))
    (d,) = only(sync.handle(Start()), Dispatch)
    commands = sync.handle(InstanceStats(0, 3, 0, 0.95, 1.0))
    assert commands == [Offload(0, "0:2")]
    assert sync.handle(InstanceStats(0, 3, 0, 0.97, 1.1)) == [Offload(0, "0:1")]
    assert sync.handle(InstanceStats(0, 3, 0, 0.99, 1.2)) == []  # keep one resident

    cfg = ControllerConfig(mode="dora", K=1, rbs=2, tbs=1, group_size=2, instances=2, slots=4)
    dora = Controller(cfg)
    dispatches = only(dora.handle(Start()), Dispatch)
    src = dispatches[0].instance_id
    dora.handle(InstanceStats(1 - src, 2, 0, 0.2, 0.5))
    commands = dora.handle(InstanceStats(src, 2, 0, 0.93, 1.0))
    (mig,) = only(commands, Migrate)
    assert mig.src == src and mig.dst == 1 - src and len(mig.request_ids) == 1
    assert violations(dora.ledger) == []
    # the peer now crosses the threshold: the moved request must not bounce back
    dora.handle(MigrationDone(mig.request_ids, mig.src, mig.dst, 1.1))
    dora.handle(InstanceStats(src, 1, 0, 0.5, 1.1))
    commands = dora.handle(InstanceStats(mig.dst, 3, 0, 0.95, 1.2))
    assert all(mig.request_ids[0] not in m.request_ids for m in only(commands, Migrate))
    assert only(commands, Offload) or only(commands, Migrate)


def test_engines_that_offload_nothing_are_relieved_by_migration_only():
    """orchestrator.engine_offload=false (vLLM's engines preempt on their own): lockstep
    pressure plans nothing, dora still moves its youngest request to a peer."""
    no_offload = OrchestratorConfig(engine_offload=False)
    sync = Controller(
        ControllerConfig(
            mode="sync", tbs=1, group_size=3, instances=1, slots=4, orchestrator=no_offload
        )
    )
    only(sync.handle(Start()), Dispatch)
    assert sync.handle(InstanceStats(0, 3, 0, 0.95, 1.0)) == []
    cfg = ControllerConfig(
        mode="dora", K=1, rbs=2, tbs=1, group_size=2, instances=2, slots=4,
        orchestrator=no_offload,
    )  # fmt: skip
    dora = Controller(cfg)
    src = only(dora.handle(Start()), Dispatch)[0].instance_id
    dora.handle(InstanceStats(1 - src, 2, 0, 0.95, 0.9))
    assert dora.handle(InstanceStats(src, 2, 0, 0.93, 1.0)) == []  # no peer under it: nothing
    dora.handle(InstanceStats(1 - src, 2, 0, 0.2, 1.1))
    (mig,) = only(dora.handle(InstanceStats(src, 2, 0, 0.95, 1.2)), Migrate)
    assert (mig.src, mig.dst) == (src, 1 - src)
    assert violations(dora.ledger) == []


def test_timer_rearms_and_finish_ends_the_protocol():
    cfg = ControllerConfig(
        mode="dora",
        K=1,
        rbs=1,
        tbs=1,
        group_size=1,
        instances=1,
        slots=1,
        steps=1,
        orchestrator=OrchestratorConfig(rebalance_period_s=30.0),
    )
    ctl = Controller(cfg)
    (d,) = only(ctl.handle(Start()), Dispatch)
    assert SetTimer(40.0) in ctl.handle(Timer(10.0))
    assert only(ctl.handle(SampleDone(d.group_id, 0, 0, 3, 11.0)), Train)
    assert only(ctl.handle(TrainDone(1, 12.0)), Finish)
    assert ctl.finished and ctl.handle(Timer(40.0)) == []


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"mode": "async"}, "mode"),
        ({"rbs": 4, "tbs": 8}, "rbs"),
        ({"K": -1}, "K"),
        ({"group_size": 9, "instances": 2, "slots": 4}, "group_size"),
        ({"max_groups": 10, "steps": 2, "tbs": 8}, "max_groups"),
        (
            {"orchestrator": OrchestratorConfig(kv_offload_threshold=0.0)},
            "orchestrator.kv_offload_threshold",
        ),
        (
            {"orchestrator": OrchestratorConfig(rebalance_period_s=0.0)},
            "orchestrator.rebalance_period_s",
        ),
        ({"versions_per_instance": 0}, "versions_per_instance"),
        ({"versions_per_instance": 2, "K": 2}, "versions_per_instance"),
        ({"versions_per_instance": 2, "mode": "sync"}, "versions_per_instance"),
    ],
)
def test_config_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=f"^{key}:"):
        ControllerConfig(**overrides).validate()


def test_modes_fix_their_knobs_and_say_so():
    cfg = ControllerConfig(mode="sync", K=3, rbs=64, tbs=32)
    assert (cfg.effective_K, cfg.rollout_batch) == (0, 32)
    assert len(cfg.ignored_settings()) == 2
    dora = ControllerConfig(mode="dora", K=1, rbs=200, tbs=32)
    assert dora.rollout_batch == 64 and "admission" in dora.ignored_settings()[0]


@pytest.mark.parametrize("kv_packing", [True, False])
def test_dora_packs_legacy_stragglers_by_kv_fit_not_slots(kv_packing):
    cfg = ControllerConfig(
        mode="dora",
        K=1,
        rbs=8,
        tbs=4,
        group_size=1,
        instances=3,
        slots=4,
        steps=5,
        orchestrator=OrchestratorConfig(kv_packing=kv_packing),
    )
    ctl = Controller(cfg)
    on = {d.group_id: d.instance_id for d in only(ctl.handle(Start()), Dispatch)}
    assert on == {0: 0, 1: 1, 2: 2, 3: 0, 4: 1, 5: 2, 6: 0, 7: 1}
    commands = []
    for g in (0, 1, 3, 4, 7, 5):
        commands += ctl.handle(SampleDone(g, 0, on[g], 10, 1.0))
    assert only(commands, Train)
    # stragglers 2 and 6 are long: one of them alone nearly fills its instance's KV
    for iid in (0, 2):
        assert ctl.handle(InstanceStats(iid, 1, 0, 0.85, 1.5)) == []
    assert ctl.ledger.instances[0].kv_fit == pytest.approx(0.9 / 0.85)
    commands = ctl.handle(TrainDone(1, 2.0))
    if kv_packing:
        # by slots both fit one instance, by KV each needs its own: only the empty one goes
        assert not only(commands, Migrate)
        assert [ld.instance_id for ld in only(commands, LoadWeights)] == [1]
        assert ctl.instance_versions() == {0: 0, 1: 1, 2: 0}
    else:
        assert only(commands, Migrate) == [Migrate(("6:0",), 0, 2)]
        assert ctl.instance_versions() == {0: 1, 1: 1, 2: 0}  # one load now, one waits
    assert violations(ctl.ledger) == []


def test_a_version_change_forgets_the_kv_fit_of_the_old_mix():
    cfg = ControllerConfig(mode="dora", K=1, rbs=2, tbs=1, group_size=1, instances=2, slots=2)
    ctl = Controller(cfg)
    on = {d.group_id: d.instance_id for d in only(ctl.handle(Start()), Dispatch)}
    ctl.handle(InstanceStats(on[1], 1, 0, 0.5, 0.5))
    assert ctl.ledger.instances[on[1]].kv_fit == pytest.approx(1.8)
    ctl.handle(SampleDone(0, 0, on[0], 5, 1.0))
    ctl.handle(SampleDone(1, 0, on[1], 5, 1.1))
    ctl.handle(TrainDone(1, 2.0))
    assert ctl.instance_versions()[on[1]] == 1
    assert ctl.ledger.instances[on[1]].kv_fit is None
