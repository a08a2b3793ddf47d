"""A dead trainer restarts from the newest checkpoint and replays the steps since (no fault
visible to the controller): the log's cuts, the checkpoint choice, and a real run."""

import json

import pytest
import ray
from hypothesis import given
from hypothesis import strategies as st
from test_ray_runtime import COMMON, DIRECT_LR, _check_invariants, _leave, _read

from dorarl.config import load_config
from dorarl.data import Group
from dorarl.errors import WorkerFailed
from dorarl.jobs.config import TrainConfig
from dorarl.jobs.workload import build_task, rollout_settings
from dorarl.record.pacing import DeviceModel
from dorarl.runtime.actor_pool import idle_actors
from dorarl.runtime.actors import (
    EngineSpec,
    TrainerSpec,
    spawn_engine,
    spawn_trainer,
    start_workers,
)
from dorarl.runtime.ray_runtime import RayRunPlan, RayRuntime, Restarts
from dorarl.runtime.recovery.trainer_log import SaveCall, TrainCall, TrainerLog
from dorarl.runtime.recovery.trainer_recovery import newest_checkpoint
from dorarl.runtime.transfer.weights_config import TransportSpec


def _batch(version):
    return [Group(group_id=version, prompt_id=0, version=version)]


def test_the_log_keeps_exactly_the_calls_a_checkpoint_lacks():
    log = TrainerLog(base=0)
    for v in range(6):
        log.record(TrainCall(v, _batch(v)))
        if v + 1 in (2, 4):
            log.record(SaveCall(v + 1, f"version_{v + 1}"))
    assert [(type(c).__name__, c.version) for c in log.since(2)] == [
        ("TrainCall", 2), ("TrainCall", 3), ("SaveCall", 4), ("TrainCall", 4), ("TrainCall", 5)
    ]  # fmt: skip
    log.durable(4)  # the v4 write finished: nothing before it is needed any more
    assert [c.version for c in log.calls] == [4, 5] and log.base == 4
    log.durable(2)  # an older write finishing late cuts nothing
    assert [c.version for c in log.calls] == [4, 5]
    with pytest.raises(RuntimeError, match="starts at v4"):
        log.since(2)


@given(
    steps=st.integers(1, 30),
    every=st.integers(1, 5),
    durable=st.lists(st.integers(0, 30), max_size=6),
    restore=st.integers(0, 30),
)
def test_replaying_the_log_from_any_kept_checkpoint_gives_back_the_whole_history(
    steps, every, durable, restore
):
    """Restoring checkpoint c and replaying `since(c)` is the full history cut at c: each step
    from c on exactly once and in order, and the checkpoint writes after c."""
    log = TrainerLog(base=0)
    for v in range(steps):  # in the order the runtime submits them
        log.record(TrainCall(v, _batch(v)))
        if (v + 1) % every == 0:
            log.record(SaveCall(v + 1, f"version_{v + 1}"))
    saved = set(range(every, steps + 1, every))
    for version in durable:
        if version in saved:
            log.durable(version)
    if restore < log.base or (restore not in saved and restore != 0):
        return
    replay = log.since(restore)
    assert [c.version for c in replay if isinstance(c, TrainCall)] == list(range(restore, steps))
    assert [c.version for c in replay if isinstance(c, SaveCall)] == sorted(
        v for v in saved if v > restore
    )


def test_the_newest_complete_checkpoint_in_range_is_chosen(tmp_path):
    for v in (2, 4, 6):
        folder = tmp_path / f"version_{v:05d}"
        folder.mkdir()
        (folder / "trainer_state.json").write_text(json.dumps({"version": v}))
    (tmp_path / "version_00008.tmp").mkdir()  # a write the dead trainer did not finish
    assert newest_checkpoint(tmp_path, 0, 10)[0] == 6
    assert newest_checkpoint(tmp_path, 0, 5)[0] == 4
    assert newest_checkpoint(tmp_path, 7, 10) is None
    assert newest_checkpoint(None, 0, 10) is None


def _runtime(
    model_dir,
    out,
    pace,
    *,
    trainer_restarts,
    every=2,
    steps=8,
    doomed_replacements=0,
    killed=None,
    kill_at=None,
    transport="object_store",
    on_step=None,
) -> RayRuntime:
    """dora K=1 on 3 engines, driven directly so a test can kill actors mid-run; checkpoints
    every `every` versions under out/checkpoints, as `dorarl train` writes them. The first
    `doomed_replacements` replacement trainers die as soon as they are made (mid-replay).
    With `kill_at`, the trainer dies when it publishes that version, before its checkpoint
    is queued (so the checkpoint is certainly unwritten); the dead actor joins `killed`."""  # fmt: skip
    folder = str(model_dir)
    overrides = [f"model={folder}", *COMMON, DIRECT_LR, "mode=dora", "K=1", f"steps={steps}"]
    config = load_config(TrainConfig, overrides=overrides)
    task = build_task(config, folder)
    engine, trainer_spec = EngineSpec(folder, config.engine), TrainerSpec(folder, config.trainer)
    workers, trainer = start_workers(3, engine, trainer_spec, pace, pool=idle_actors())
    replacements = []

    def respawn_trainer(ckpt):
        replacements.append(spawn_trainer(trainer_spec.restored(ckpt), pace))
        if len(replacements) <= doomed_replacements:
            ray.kill(replacements[-1])
        return replacements[-1]

    restarts = Restarts(
        engines=2, respawn_engine=lambda i: spawn_engine(i, engine, pace),
        trainer=trainer_restarts, respawn_trainer=respawn_trainer,
        checkpoints=out / "checkpoints",
    )  # fmt: skip
    plan = RayRunPlan(
        config.controller_config(None), task, rollout_settings(config, task), workers, trainer,
        restarts=restarts, transport=TransportSpec(kind=transport), out_dir=out,
    )  # fmt: skip

    def on_publish(version):
        trainer = runtime.trainer_client
        if version == kill_at and not killed:
            killed.append(trainer.actor)
            _kill_and_wait(trainer.actor)
        if version % every == 0 and version < steps:
            position = runtime.driver.controller.resume_state()
            trainer.save_checkpoint(out / "checkpoints" / f"version_{version:05d}", position, 0)

    runtime = RayRuntime(plan, on_step=on_step, on_publish=on_publish)
    return runtime


def _kill_and_wait(actor):
    """ray.kill returns at once; wait until the actor answers no more (its process is gone)."""
    ray.kill(actor)
    with pytest.raises(ray.exceptions.RayActorError):
        for _ in range(100):
            ray.get(actor.version.remote(), timeout=30)


@pytest.mark.slow
@pytest.mark.usefixtures("shared_ray")
@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_a_dead_trainer_restarts_from_a_checkpoint_and_replays_the_lost_steps(
    tmp_path, tiny_model_dir, transport
):
    """Killed as it publishes v4: on the collective transport the engines then load v4 from
    the dead trainer itself, and that failed load is what reveals its death."""
    out = tmp_path / "run"
    runtime = None
    try:
        pace = DeviceModel(decode_step_s=0.02, train_fixed_s=0.05)  # keep requests in flight
        # killed as v4 is published, so v4's checkpoint is never written by it: the new
        # trainer starts from v2 and makes v3 and v4 again; the first replacement dies too,
        # before its replay is done: replayed again
        killed = []
        runtime = _runtime(tiny_model_dir, out, pace, trainer_restarts=2, doomed_replacements=1,
                           killed=killed, kill_at=4, transport=transport)  # fmt: skip
        summary = runtime.run()
        ray.get(runtime.trainer_client.save_checkpoint(out / "checkpoints" / "version_00008",
                runtime.driver.controller.resume_state(), 0))  # fmt: skip
    finally:
        _leave(runtime)
    assert killed and runtime.trainer_client.actor is not killed[0]
    assert summary["steps"] == 8 and summary["trainer_restarts"] == 2
    assert summary["replayed_steps"] == 2 * 2  # v2 -> v3 -> v4 made again, twice
    assert summary["replay_mismatches"] == 0  # CPU training is deterministic: same versions
    summary, trajectories, metrics, _ = _read(out)
    _check_invariants(summary, trajectories, k=1)
    assert [m["step"] for m in metrics] == list(range(8))  # no row from a replayed step
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved == [f"version_{v:05d}" for v in (2, 4, 6, 8)]  # v4 written by the new one


@pytest.mark.slow
@pytest.mark.usefixtures("shared_ray")
def test_a_dead_trainer_stops_the_run_when_restarts_are_off(tmp_path, tiny_model_dir):
    runtime = None
    try:

        def kill(row, groups):
            if row["step"] == 1:
                ray.kill(runtime.trainer_client.actor)

        runtime = _runtime(tiny_model_dir, tmp_path / "run", None, trainer_restarts=0, on_step=kill)
        with pytest.raises(WorkerFailed, match=r"^the trainer \(.*\) failed: ActorDied"):
            runtime.run()
    finally:
        _leave(runtime, finished=False)
