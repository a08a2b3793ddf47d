"""Engine recovery under the interleavings Ray allows, made to happen on purpose.

Ray orders the calls of one actor, nothing across actors: a migration into a dead engine
can fail before the source's earlier stepping burst reports, and an import that landed on
an engine that died since can report after the engine was replaced. Each test builds
that moment with real actors (the runtime started, an engine killed, the answers handed
to the runtime in the chosen order), then lets the run finish: every request is reported
once and only by the engine that holds it, and the run's invariants hold.
"""

import logging

import pytest
import ray
from test_ray_runtime import _check_invariants, _dora_k1_runtime, _leave, _read

from dorarl.controller import Migrate
from dorarl.runtime.calls import MigrateCall

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]

SHORT = ["instances=2", "tbs=2", "rbs=4", "forced_lengths.median=3", "forced_lengths.max_len=6",
         "forced_lengths.p99_ratio=2"]  # fmt: skip
"""Two engines; responses of 1-6 tokens, so a stepping burst finishes some of them."""


def _kill(actor):
    ray.kill(actor)
    with pytest.raises(ray.exceptions.RayActorError):
        for _ in range(100):
            ray.get(actor.stats.remote(), timeout=30)


def _finished_by(ref) -> list[str]:
    """What a `run` call reported finished, read without taking its answer."""
    return [out.request_id for out in ray.get(ref).finished]


def _refused(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]


@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_a_migration_into_a_dead_engine_that_fails_before_the_sources_report(
    tmp_path, tiny_model_dir, caplog, transport
):
    """The old recovery restarted every migrated request not yet reported on the new
    destination; the source's report then finished one of them as well: a fifth sample
    ("group is incomplete"), or a zombie copy on the destination. Over the group, the KV
    the source holds goes to the replacement (outside the group) as a Ray object."""
    out = tmp_path / "run"
    runtime = None
    try:
        overrides = (*SHORT, f"weights.transport={transport}")
        runtime = _dora_k1_runtime(tiny_model_dir, out, None, 2, *overrides)
        runtime.start()  # groups dispatched on both engines, a `run` queued on each
        burst = runtime.engines.running_call(0)
        done_on_source = _finished_by(burst)  # finished there; the runtime does not know yet
        assert done_on_source
        _kill(runtime.engines.workers[1])
        runtime.driver.execute(Migrate((done_on_source[0],), src=0, dst=1))
        (migration,) = runtime.calls.of_kind(MigrateCall)
        assert migration.parcel == (transport == "collective")  # KV kept out of the store
        with caplog.at_level(logging.WARNING):
            runtime.answer(migration.ref)  # the failed import first, as Ray may deliver it
            assert runtime.engines.generations == [0, 1]  # engine 1 was replaced
            runtime.answer(burst)  # then the source's report
            summary = runtime.run()
        # the source held the KV for the dead destination until the replacement took it
        assert ray.get(runtime.engines.workers[0].held_tickets.remote()) == 0
    finally:
        _leave(runtime)
    assert summary["engine_restarts"] == 1 and summary["steps"] == 8
    assert _refused(caplog) == []  # no engine ran a request another had finished
    summary, trajectories, _, _ = _read(out)
    _check_invariants(summary, trajectories, k=1)


def test_an_import_that_landed_on_an_engine_replaced_since(tmp_path, tiny_model_dir, caplog):
    """The import succeeded, then its destination died and was replaced before the import's
    answer was read: the old runtime placed the requests on the replacement, which never
    had them (they were lost and the run could not finish)."""
    out = tmp_path / "run"
    runtime = None
    try:
        runtime = _dora_k1_runtime(tiny_model_dir, out, None, 2, *SHORT)
        runtime.start()
        burst = runtime.engines.running_call(0)
        ray.wait([burst])
        finished = set(_finished_by(burst))
        requests = runtime.driver.controller.instance(0).requests
        moving = [r for r in requests if r not in finished][:1]
        assert moving
        runtime.driver.execute(Migrate(tuple(moving), src=0, dst=1))
        (migration,) = runtime.calls.of_kind(MigrateCall)
        assert ray.get(migration.ref) == moving  # landed on engine 1
        _kill(runtime.engines.workers[1])
        with caplog.at_level(logging.WARNING):
            runtime.answer(runtime.engines.running_call(1))  # queued before the import: done
            doomed = runtime.engines.running_call(1)  # queued on the dead actor
            ray.wait([doomed])
            runtime.answer(doomed)  # engine 1's death: it is replaced
            assert runtime.engines.generations == [0, 1]
            runtime.answer(migration.ref)  # then the import's answer, from the dead actor
            summary = runtime.run()
    finally:
        _leave(runtime)
    assert summary["engine_restarts"] == 1 and summary["steps"] == 8
    assert _refused(caplog) == []
    summary, trajectories, _, _ = _read(out)
    _check_invariants(summary, trajectories, k=1)


@ray.remote(num_cpus=0)
def _refused_load() -> None:
    raise RuntimeError("WeightsRefused: the load was refused")


def test_a_replacement_that_cannot_take_its_version_back_is_replaced(tmp_path, tiny_model_dir):
    """The first replacement's restore fails: it holds the weights it started on, which it
    would serve under the hosted version's name. It is replaced in turn (two restarts),
    and the run finishes with its audit intact."""
    out = tmp_path / "run"
    runtime = None
    try:
        runtime = _dora_k1_runtime(tiny_model_dir, out, None, 2, *SHORT)
        fleet, failed = runtime.engines, []
        restore = fleet.restore

        def restore_failing_once(iid, version, source):
            carry = fleet._carry
            if not failed:  # the first restore's load is refused, as a bad copy's would be
                fleet._carry = lambda *args: failed.append(args) or _refused_load.remote()
            try:
                restore(iid, version, source)
            finally:
                fleet._carry = carry

        fleet.restore = restore_failing_once
        runtime.start()
        _kill(fleet.workers[1])
        summary = runtime.run()
    finally:
        _leave(runtime)
    assert failed and failed[0][0] == 1  # instance 1's restore was the one refused
    assert summary["engine_restarts"] == 2 and summary["steps"] == 8
    causes = [d["cause"] for d in summary["deaths"]]
    assert any("taking version" in c and "WeightsRefused" in c for c in causes), causes
    summary, trajectories, _, _ = _read(out)
    _check_invariants(summary, trajectories, k=1)
