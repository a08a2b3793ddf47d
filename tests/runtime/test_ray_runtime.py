"""End to end on local Ray: real engines and trainer as actors, invariants from the run files."""

import json
from collections import defaultdict

import pytest
import ray

from dorarl.config import load_config
from dorarl.errors import WorkerFailed
from dorarl.jobs.config import TrainConfig
from dorarl.jobs.evaluation import with_evaluations
from dorarl.jobs.ray_run import run_ray, run_segment
from dorarl.jobs.train import main as train_main
from dorarl.jobs.workload import build_task, rollout_settings
from dorarl.record.pacing import DeviceModel
from dorarl.record.segments import open_segment
from dorarl.runtime.actor_pool import idle_actors, stop_actors
from dorarl.runtime.actors import EngineSpec, TrainerSpec, spawn_engine, start_workers
from dorarl.runtime.ray_runtime import RayRunPlan, RayRuntime, Restarts, _describe

pytestmark = pytest.mark.slow

DIRECT_LR = "trainer.lr=2e-4"
"""A runtime driven directly is given its rate (run_ray chooses one by the model)."""
COMMON = [
    "instances=3",
    "tbs=4",
    "rbs=8",
    "group_size=4",
    "engine.max_num_seqs=8",
    "eval.max_prompts=8",
    "eval.every=0",
    "progress=false",
    "forced_lengths.enabled=true",
    "forced_lengths.median=32",
    "forced_lengths.max_len=240",
    "engine.max_model_len=320",
]


def _run(tmp_path, model, *overrides):
    out = tmp_path / "run"
    rc = train_main([f"model={model}", *COMMON, *overrides, "--out", str(out)])
    assert rc == 0
    return (out, *_read(out))


def _read(out):
    summary = json.loads((out / "summary.json").read_text())
    trajectories = [json.loads(line) for line in (out / "trajectories.jsonl").open()]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    trace = json.loads((out / "trace.json").read_text())
    return summary, trajectories, metrics, trace


def _check_invariants(summary, trajectories, k, one_version_per_group=True, group_size=4):
    """The audit of a run's files: dispatched = consumed + filtered + in flight + queued,
    nothing dropped; every group trained once or filtered once, never both; Eq. 1 for
    every trained trajectory; one version per group."""
    assert summary["dropped_total"] == 0
    trained = [t for t in trajectories if not t.get("filtered")]
    filtered = [t for t in trajectories if t.get("filtered")]
    assert summary["consumed"] * group_size == len(trained)
    assert summary["filtered"] * group_size == len(filtered)
    ended = summary["consumed"] + summary["filtered"]
    accounted = ended + summary["in_flight_at_end"] + summary["queued_at_end"]
    assert summary["dispatched"] == accounted
    assert not {t["group_id"] for t in trained} & {t["group_id"] for t in filtered}
    seen = set()
    versions = defaultdict(set)
    for t in trajectories:
        key = (t["group_id"], t["sample_index"])
        assert key not in seen, f"trajectory {key} consumed or filtered twice"
        seen.add(key)
        behavior = t["behavior_version"]
        versions[t["group_id"]].add(behavior if isinstance(behavior, int) else tuple(behavior))
        if t.get("filtered"):
            continue
        oldest = min(behavior) if isinstance(behavior, list) else behavior
        newest = max(behavior) if isinstance(behavior, list) else behavior
        assert 0 <= t["train_version"] - oldest <= k, t
        assert newest <= t["train_version"], t
    if one_version_per_group:
        assert all(len(v) == 1 for v in versions.values())


@pytest.mark.usefixtures("shared_ray")
def test_dora_migrates_with_kv_and_loads_weights_peer_to_peer(tmp_path, tiny_model_dir):
    # Paced engine steps (a device-like 20 ms each) keep the long tail in flight across
    # version changes however fast this CPU is, so the orchestrator has requests to move.
    overrides = [f"model={tiny_model_dir}", *COMMON, "mode=dora", "K=1", "steps=12"]
    overrides.append("weights.transport=collective")  # peer loads over the group
    out = tmp_path / "run"
    config = load_config(TrainConfig, overrides=overrides)
    run_ray(config, None, out, pace=DeviceModel(decode_step_s=0.02, train_fixed_s=0.05))
    summary, trajectories, metrics, trace = _read(out)
    _check_invariants(summary, trajectories, k=1)
    assert summary["steps"] == 12 and len(metrics) == 12
    # each engine's set-up, reported at start: none of its chosen paths fell back
    assert set(summary["engines"]) == {str(i) for i in range(config.instances)}
    assert summary["fast_path_fallbacks"] == []
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    loads = [e["name"] for e in events if e.get("name", "").startswith("load v")]
    assert any("from instance" in name for name in loads), loads
    assert summary["migrations"] > 0
    # Only overheads the Ray runtime measures: no free_cache step exists to time.
    assert all(set(m["overhead_s"]) == set(RayRuntime.OVERHEAD_KINDS) for m in metrics)
    assert set(summary["overhead_share"]) == set(RayRuntime.OVERHEAD_KINDS)
    assert sum(m["overhead_s"]["load_balance"] for m in metrics) > 0
    migrated = [t for t in trajectories if t["migrations"] > 0]
    assert all(isinstance(t["behavior_version"], int) for t in migrated)
    metrics = with_evaluations(out)  # evaluations.jsonl joined to the steps, by version
    assert metrics[0]["eval_accuracy"] is not None and metrics[-1]["eval_accuracy"] is not None
    assert (out / "reward_curve.png").exists()
    assert (out / "dashboard.png").read_bytes()[:4] == b"\x89PNG"
    assert list((out / "checkpoints").iterdir())


@pytest.mark.parametrize(
    ("mode", "k", "transport"), [("sync", 0, "object_store"), ("one_step_off", 1, "collective")]
)
@pytest.mark.usefixtures("shared_ray")
def test_lockstep_modes(tmp_path, tiny_model_dir, mode, k, transport):
    transport = f"weights.transport={transport}"
    _, summary, trajectories, _, _ = _run(
        tmp_path, tiny_model_dir, f"mode={mode}", "steps=3", transport
    )
    _check_invariants(summary, trajectories, k=k)
    stale = {t["train_version"] - t["behavior_version"] for t in trajectories}
    assert stale == ({0} if mode == "sync" else {0, 1})


@pytest.mark.usefixtures("shared_ray")
def test_dynamic_sampling_filters_uniform_groups_and_accounts_for_them(tmp_path, tiny_model_dir):
    # A random model's responses score 0 almost always: groups are uniform, so every version
    # uses its budget of 3 and then trains on uniform groups (the fallback); the simulator's
    # property tests cover every mode and any share of uniform groups.
    _, summary, trajectories, metrics, _ = _run(
        tmp_path, tiny_model_dir, "mode=dora", "K=1", "steps=3",
        "rollout.filter_groups=true", "rollout.max_filtered_per_step=3",
    )  # fmt: skip
    _check_invariants(summary, trajectories, k=1)
    assert summary["steps"] == 3 and summary["filtered"] > 0
    assert sum(m["filtered_groups"] for m in metrics) == summary["filtered"]
    assert all(m["filtered_groups"] <= 3 and m["consumed_groups"] == 4 for m in metrics)
    by_group = defaultdict(list)
    for t in trajectories:
        by_group[t["group_id"]].append(t)
    for rows in by_group.values():
        if rows[0].get("filtered"):
            assert len(rows) == 4 and len({t["reward"] for t in rows}) == 1  # uniform
            assert len({t["filtered_step"] for t in rows}) == 1
        elif len({t["reward"] for t in rows}) == 1:  # trained uniform: the budget ran out
            assert any(m["filtered_groups"] == 3 for m in metrics)


@pytest.mark.usefixtures("shared_ray")
def test_partial_rollout_keeps_per_token_versions(tmp_path, tiny_model_dir):
    _, summary, trajectories, metrics, _ = _run(
        tmp_path, tiny_model_dir, "mode=partial_rollout", "K=1", "steps=4"
    )
    _check_invariants(summary, trajectories, k=1, one_version_per_group=False)
    assert all(isinstance(t["behavior_version"], list) for t in trajectories)
    assert all(len(t["behavior_version"]) == t["response_tokens"] for t in trajectories)


@pytest.mark.usefixtures("shared_ray")
def test_raising_reward_is_counted_and_never_stops_the_run(tmp_path, tiny_model_dir):
    data = tmp_path / "data.jsonl"
    rows = [
        {"prompt": f"{i}+{i}=", "answer": str(2 * i) if i % 2 else "not math ]["} for i in range(40)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    overrides = [*COMMON, "task.name=jsonl", f"task.path={data}", "task.reward=math", "steps=2",
                 "record.text=true"]  # fmt: skip
    assert train_main([f"model={tiny_model_dir}", *overrides, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert summary["dropped_total"] == 0 and summary["steps"] == 2
    rows = [json.loads(line) for line in (out / "trajectories.jsonl").open()]
    assert all(row["prompt"].endswith("=") and isinstance(row["response"], str) for row in rows)
    # every trained error was counted by its step's row; the run's total also counts samples
    # scored after the last step (in flight at the end, never trained)
    trained_errors = sum(1 for row in rows if "error" in row)
    assert 0 < trained_errors <= metrics[-1]["reward_errors"] <= summary["reward_errors"]
    assert all(row["reward"] == 0.0 for row in rows if "error" in row)


def _dora_k1_runtime(
    model_dir, out=None, pace=None, max_restarts=0, *extra, records_dir=None, on_step=None
) -> RayRuntime:
    """dora K=1 for 8 steps on 3 engines (`extra` overrides change that), driven directly so
    a test can reach in mid-run (local Ray must be up); with `max_restarts`, dead engines
    are replaced."""
    folder = str(model_dir)
    overrides = [f"model={folder}", *COMMON, "mode=dora", "K=1", "steps=8", *extra]
    config = load_config(TrainConfig, overrides=[*overrides, DIRECT_LR])
    task = build_task(config, folder)
    engine = EngineSpec(folder, config.engine)
    workers, trainer = start_workers(
        config.instances, engine, TrainerSpec(folder, config.trainer), pace, pool=idle_actors()
    )
    restarts = Restarts(
        engines=max_restarts, respawn_engine=lambda i: spawn_engine(i, engine, pace)
    )
    transport = config.weights.spec(
        config.engine.device, config.trainer.device, config.engine.dtype,
        adapters=config.adapter_versions,
    )  # fmt: skip
    plan = RayRunPlan(
        config.controller_config(None), task, rollout_settings(config, task), workers, trainer,
        restarts=restarts, transport=transport, out_dir=out, records_dir=records_dir,
    )  # fmt: skip
    return RayRuntime(plan, on_step=on_step)


def _leave(runtime: RayRuntime | None, finished: bool = True) -> None:
    """A runtime-driven test's end in the shared Ray: its actors go back idle to the test
    process's pool (a run that finished; dorarl.runtime.actor_pool) or are killed."""
    if runtime is None:
        return
    actors = [*runtime.engines.workers, runtime.trainer_client.actor]
    stop_actors(actors, idle_actors(), keep=finished)


@pytest.mark.usefixtures("shared_ray")
def test_a_dead_engine_stops_the_run_naming_it(tmp_path, tiny_model_dir):
    runtime = None
    try:
        segment = open_segment(tmp_path, 0, instances=3, slots=8)

        def kill_instance_1(row, groups):
            if row["step"] == 1:
                ray.kill(runtime.engines.workers[1])

        runtime = _dora_k1_runtime(
            tiny_model_dir, tmp_path, records_dir=segment, on_step=kill_instance_1
        )
        with pytest.raises(WorkerFailed, match=r"^engine instance 1 \(.*\) failed: ActorDied"):
            run_segment(runtime, tmp_path, segment)
        assert runtime.driver.controller.counts()["steps_done"] < 8
    finally:
        _leave(runtime, finished=False)
    # the failed segment is recorded as such, and the run's summary and trace with it
    (entry,) = json.loads((tmp_path / "summary.json").read_text())["segments"]
    assert entry["ended"] == "failed" and entry["end_version"] >= 2
    assert json.loads((segment / "summary.json").read_text())["ended"] == "failed"
    assert (tmp_path / "trace.json").is_file()


def test_a_worker_error_leads_with_the_workers_own_exception():
    class Wrapped(Exception):
        cause = ValueError("weights of the wrong shape: lm_head")

        def __str__(self):
            return "ray::EngineWorker.load_weights() (pid=1)\nTraceback ..."

    failed = WorkerFailed("engine instance 0 (weight load)", _describe(Wrapped()))
    assert str(failed) == (
        "engine instance 0 (weight load) failed: ValueError: weights of the wrong shape: lm_head"
    )
    assert "Traceback" in failed.detail


@pytest.mark.parametrize(("victim", "transport"), [(0, "collective"), (1, "object_store")])
@pytest.mark.usefixtures("shared_ray")
def test_a_dead_engine_is_replaced_and_the_run_completes(
    tmp_path, tiny_model_dir, victim, transport
):
    out = tmp_path / "run"
    runtime = None
    try:
        pace = DeviceModel(decode_step_s=0.02, train_fixed_s=0.05)  # keep requests in flight
        transport = f"weights.transport={transport}"  # collective: the replacement is outside
        killed = []

        def kill_once(row, groups):
            if row["step"] == 2 and not killed:
                killed.append(runtime.engines.workers[victim])
                ray.kill(runtime.engines.workers[victim])

        runtime = _dora_k1_runtime(tiny_model_dir, out, pace, 2, transport, on_step=kill_once)
        summary = runtime.run()
    finally:
        _leave(runtime)
    assert killed and summary["steps"] == 8 and summary["engine_restarts"] == 1
    summary, trajectories, metrics, trace = _read(out)
    _check_invariants(summary, trajectories, k=1)
    assert [m["step"] for m in metrics] == list(range(8))
    # the death is recorded with its cause, in summary.json and on the instance's trace track
    (death,) = summary["deaths"]
    assert death["worker"] == f"engine instance {victim}"
    assert death["cause"] == "killed by ray.kill"
    names = [e["name"] for e in trace["traceEvents"] if e.get("pid") == victim + 1]
    assert f"engine instance {victim} died: killed by ray.kill" in names
