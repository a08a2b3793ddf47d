"""The recorder on a hand-written event/command stream, with hand-computed expectations."""

import json

import pytest

from dorarl.controller import (
    TRAINER,
    Dispatch,
    FilterGroup,
    Finish,
    Interrupt,
    LoadWeights,
    Migrate,
    MigrationDone,
    Resume,
    SampleDone,
    Start,
    Train,
    TrainDone,
    WeightsLoaded,
)
from dorarl.data import Group, Sample
from dorarl.record import Recorder


def group(gid, version, lengths, versions=None, reward=1.0):
    samples = [
        Sample(
            gid,
            i,
            prompt_id=gid,
            prompt_ids=[1, 2],
            response_ids=[7] * n,
            versions=versions or [version] * n,
            reward=reward,
        )
        for i, n in enumerate(lengths)
    ]
    return Group(gid, gid, version, samples)


def test_one_step_metrics_trajectories_summary_and_trace(tmp_path):
    rec = Recorder(tmp_path, mode="dora", k=1, num_instances=2, slots_per_instance=2)
    rec.observe(
        Start(0.0),
        [Dispatch(0, 0, 0, 0, (0, 1)), Dispatch(1, 1, 0, 1, (0,)), Dispatch(1, 1, 0, 0, ())],
    )
    # group 1 sample 1 joins instance 1 later
    rec.observe(SampleDone(0, 0, 0, 3, 1.0), [Dispatch(1, 1, 0, 1, (1,))])
    rec.observe(SampleDone(0, 1, 0, 5, 2.0), [Train((0,), 0)])
    rec.consumed([group(0, 0, [3, 5], reward=0.5)], 0)
    rec.overhead("load_balance", 0.25)
    rec.step_metrics({"loss": 1.5})
    rec.observe(TrainDone(1, 4.0), [LoadWeights(0, 1, TRAINER)])
    rec.observe(WeightsLoaded(0, 1, 4.5), [Migrate(("1:0",), 1, 0)])
    rec.observe(MigrationDone(("1:0",), 1, 0, 4.6), [])
    rec.observe(SampleDone(1, 0, 0, 2, 5.0), [])
    summary = rec.close(6.0)

    (line,) = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert (
        line["step_time_s"] == 4.0 and line["rollout_only_s"] == 2.0 and line["train_time_s"] == 2.0
    )
    assert (
        line["consumed_tokens"] == 8 and line["tokens_per_s"] == 2.0 and line["reward_mean"] == 0.5
    )
    assert line["staleness"] == {"0": 1} and line["loss"] == 1.5
    assert line["instances_per_version"] == {"0": 2}  # as the step ended, before the reload
    # busy slot-seconds over [0, 4]: instance 0 has 2 slots busy until 1.0 then 1 until 2.0 -> 3;
    # instance 1 has 1 from 0 and 2 from 1.0 -> 7; capacity 2 slots x 4 s each
    assert line["slot_utilization_per_instance"] == pytest.approx([3 / 8, 7 / 8])
    assert line["overhead_s"]["load_balance"] == 0.25
    assert line["overhead_share"]["load_balance"] == pytest.approx(0.25 / 8)

    trajectories = [
        json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()
    ]
    assert [
        (t["sample_index"], t["behavior_version"], t["train_version"], t["response_tokens"])
        for t in trajectories
    ] == [
        (0, 0, 0, 3),
        (1, 0, 0, 5),
    ]
    assert summary["dispatched"] == 2 and summary["consumed"] == 1
    assert summary["in_flight_at_end"] == 1 and summary["queued_at_end"] == 0
    assert summary["dropped_total"] == 0 and summary["steps"] == 1
    assert summary == json.loads((tmp_path / "summary.json").read_text())

    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    names = {e["name"] for e in trace}
    assert {
        "busy_slots",
        "train step 0 (v0 -> v1)",
        "load v1 from trainer",
        "migrate 1 -> instance 0",
    } <= names
    assert any(e["name"] == "v0" and e["pid"] == 1 and e["dur"] == 4.0e6 for e in trace)


def test_partial_rollout_writes_per_token_versions_and_counts_reprefill(tmp_path):
    rec = Recorder(tmp_path, mode="partial_rollout", k=2, num_instances=1, slots_per_instance=4)
    rec.observe(Start(0.0), [Dispatch(0, 0, 0, 0, (0,)), Dispatch(1, 1, 0, 0, (0,))])
    rec.observe(SampleDone(1, 0, 0, 1, 0.5), [Train((1,), 0)])
    rec.consumed([group(1, 0, [1])], 0)
    rec.observe(TrainDone(1, 1.0), [Interrupt(0, ("0:0",)), LoadWeights(0, 1, TRAINER)])
    rec.observe(WeightsLoaded(0, 1, 1.5), [Resume(("0:0",), 0, 1)])
    rec.reprefill(12)
    rec.observe(SampleDone(0, 0, 0, 4, 2.0), [Train((0,), 1)])
    rec.consumed([group(0, 0, [4], versions=[0, 0, 1, 1])], 1)
    rec.observe(TrainDone(2, 3.0), [Finish("done")])
    rec.close(3.0)
    t = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()][-1]
    assert t["behavior_version"] == [0, 0, 1, 1] and t["train_version"] == 1
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[1]["reprefill_tokens"] == 12 and lines[1]["staleness"] == {"1": 1}


def test_prefill_work_and_mixed_version_steps_per_step_and_the_cached_blocks_each_instance_last_reported(
    tmp_path,
):
    rec = Recorder(tmp_path, mode="sync", k=0, num_instances=2, slots_per_instance=4)
    rec.observe(Start(0.0), [Dispatch(0, 0, 0, 0, (0, 1))])
    rec.prefill(0, 512 + 1, 511, 40)
    rec.prefill(1, 100, 0, 7)
    rec.prefill(0, 0, 0, 33)  # instance 0 evicted some: the latest count stands
    rec.mixed_steps(3)
    rec.mixed_steps(2)
    rec.observe(SampleDone(0, 0, 0, 2, 1.0), [])
    rec.observe(SampleDone(0, 1, 0, 2, 1.5), [Train((0,), 0)])
    rec.consumed([group(0, 0, [2, 2])], 0)
    rec.observe(TrainDone(1, 2.0), [Finish("done")])
    summary = rec.close(2.0)
    (line,) = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert (line["prefill_tokens"], line["prefill_saved_tokens"]) == (613, 511)
    assert line["prefix_hit_rate"] == pytest.approx(511 / 1124)
    assert line["cached_blocks"] == 33 + 7
    assert (summary["prefill_tokens"], summary["prefill_saved_tokens"]) == (613, 511)
    assert line["mixed_version_steps"] == summary["mixed_version_steps"] == 5


def test_consuming_an_incomplete_or_unknown_group_is_reported_as_dropped(tmp_path):
    rec = Recorder(tmp_path, mode="sync", k=0, num_instances=1, slots_per_instance=4)
    rec.observe(Start(0.0), [Dispatch(0, 0, 0, 0, (0, 1))])
    rec.observe(SampleDone(0, 0, 0, 2, 1.0), [Train((0,), 0)])
    rec.consumed([group(0, 0, [2, 2]), group(9, 0, [1])], 0)
    rec.lost(5, "engine_crashed")
    summary = rec.close(2.0)
    assert summary["dropped"] == {
        "consumed_while_running": 1,
        "consumed_while_unknown": 1,
        "engine_crashed": 1,
    }
    assert summary["dropped_total"] == 3


def test_a_filtered_group_is_marked_counted_in_its_step_and_ends_once(tmp_path):
    rec = Recorder(tmp_path, mode="dora", k=1, num_instances=1, slots_per_instance=4)
    rec.observe(Start(0.0), [Dispatch(0, 0, 0, 0, (0, 1)), Dispatch(1, 1, 0, 0, (0, 1))])
    rec.observe(SampleDone(0, 0, 0, 2, 0.5, 1.0), [])
    rec.observe(SampleDone(0, 1, 0, 2, 1.0, 1.0), [FilterGroup(0, 0, 0)])
    rec.filtered(group(0, 0, [2, 2]), 0)
    rec.observe(SampleDone(1, 0, 0, 3, 1.5, 0.0), [])
    rec.observe(SampleDone(1, 1, 0, 3, 2.0, 1.0), [Train((1,), 0)])
    rec.consumed([group(1, 0, [3, 3])], 0)
    rec.observe(TrainDone(1, 3.0), [])
    rec.filtered(group(0, 0, [2, 2]), 1)  # a second end of group 0: reported, not hidden
    rec.consumed([group(0, 0, [2, 2])], 1)
    summary = rec.close(3.0)
    (line,) = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert line["filtered_groups"] == 1 and line["consumed_groups"] == 1
    rows = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert [(r["group_id"], r.get("filtered"), r.get("filtered_step")) for r in rows[:2]] == [
        (0, True, 0),
        (0, True, 0),
    ]
    assert all("train_version" not in r for r in rows[:2]) and rows[2]["train_version"] == 0
    assert summary["dropped"] == {"filtered_while_filtered": 1, "consumed_while_filtered": 1}


def test_without_an_output_folder_the_recorder_keeps_results_in_memory():
    rec = Recorder(None, mode="dora", k=1, num_instances=1, slots_per_instance=1)
    rec.observe(Start(0.0), [Dispatch(0, 0, 0, 0, (0,))])
    rec.observe(SampleDone(0, 0, 0, 2, 1.0), [Train((0,), 0)])
    rec.consumed([group(0, 0, [2])], 0)
    rec.observe(TrainDone(1, 2.0), [])
    assert rec.steps[0]["consumed_tokens"] == 2 and rec.close(2.0)["consumed"] == 1
    with pytest.raises(ValueError, match="unknown overhead kind"):
        rec.overhead("gc", 1.0)


def test_a_run_reports_only_the_overheads_it_measures(tmp_path):
    kinds = ("load_balance", "request_transfer")
    rec = Recorder(tmp_path, mode="dora", k=1, num_instances=1, slots_per_instance=1,
                   overhead_kinds=kinds)  # fmt: skip
    rec.observe(Start(0.0), [Dispatch(0, 0, 0, 0, (0,))])
    rec.observe(SampleDone(0, 0, 0, 2, 1.0), [Train((0,), 0)])
    rec.consumed([group(0, 0, [2])], 0)
    rec.overhead("request_transfer", 0.5)
    with pytest.raises(ValueError, match="'free_cache' is not measured by this run"):
        rec.overhead("free_cache", 0.0)
    rec.observe(TrainDone(1, 2.0), [])
    summary = rec.close(2.0)
    (line,) = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert line["overhead_s"] == {"load_balance": 0.0, "request_transfer": 0.5}
    assert set(line["overhead_share"]) == set(kinds) == set(summary["overhead_share"])
    with pytest.raises(ValueError, match="unknown overhead kinds"):
        Recorder(None, mode="dora", k=1, num_instances=1, slots_per_instance=1,
                 overhead_kinds=("gc",))  # fmt: skip


def test_the_ray_runtimes_own_recorder_refuses_free_cache():
    """The Ray runtime builds its Recorder with the overheads it measures (no actor is
    reached before `start`, so none is needed here)."""
    from dorarl.controller import ControllerConfig
    from dorarl.runtime.ray_runtime import RayRunPlan, RayRuntime, RolloutSettings
    from dorarl.tasks import make_task

    assert "free_cache" not in RayRuntime.OVERHEAD_KINDS
    task = make_task("running_sum", seed=0)
    rec = RayRuntime(RayRunPlan(ControllerConfig(), task, RolloutSettings(), [], None)).recorder
    assert rec.overhead_kinds == RayRuntime.OVERHEAD_KINDS
    with pytest.raises(ValueError, match="'free_cache' is not measured by this run"):
        rec.overhead("free_cache", 0.0)


def test_the_engines_setups_and_their_fast_path_fallbacks_reach_the_summary(tmp_path):
    rec = Recorder(tmp_path, mode="dora", k=1, num_instances=2, slots_per_instance=1)
    assert "fast_path_fallbacks" not in rec.close(0.0)  # a runtime that reports none (sim)
    rec = Recorder(tmp_path, mode="dora", k=1, num_instances=2, slots_per_instance=1)
    fallback = {"path": "attention", "instead": "torch", "error": "RuntimeError: ptxas"}
    rec.engine_setup(1, {"attention": "torch", "fast_path_fallbacks": [fallback]})
    rec.engine_setup(0, {"attention": "triton", "fast_path_fallbacks": []})
    rec.close(1.0)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["fast_path_fallbacks"] == [{"instance": 1, **fallback}]
    assert summary["engines"]["0"]["attention"] == "triton"


def test_an_moe_steps_expert_load_reaches_the_metrics_and_the_trainers_counters(tmp_path):
    rec = Recorder(tmp_path, mode="sync", k=0, num_instances=1, slots_per_instance=1)
    rec.observe(Start(0.0), [Dispatch(0, 0, 0, 0, (0,))])
    rec.observe(SampleDone(0, 0, 0, 3, 1.0), [Train((0,), 0)])
    rec.consumed([group(0, 0, [3])], 0)
    rec.step_metrics({"moe_tokens_per_expert": {"0": 5.0, "1": 1.0}, "moe_imbalance": 1.6})
    rec.observe(TrainDone(1, 2.0), [])
    rec.close(3.0)
    (line,) = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert line["moe_tokens_per_expert"] == {"0": 5.0, "1": 1.0} and line["moe_imbalance"] == 1.6
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    load = [e for e in trace if e["name"] == "tokens per expert"]
    assert load == [
        {"name": "tokens per expert", "ph": "C", "pid": 0, "ts": 2.0e6,
         "args": {"expert 0": 5.0, "expert 1": 1.0}}
    ]  # fmt: skip
    (imbalance,) = [e for e in trace if e["name"] == "expert imbalance"]
    assert imbalance["args"] == {"expert imbalance": 1.6}


def test_a_users_reward_parts_reach_the_metrics_row_as_means_and_each_trajectory_row(tmp_path):
    rec = Recorder(tmp_path, mode="sync", k=0, num_instances=1, slots_per_instance=2)
    rec.observe(Start(0.0), [Dispatch(0, 0, 0, 0, (0, 1))])
    rec.observe(SampleDone(0, 0, 0, 3, 1.0), [])
    rec.observe(SampleDone(0, 1, 0, 3, 2.0), [Train((0,), 0)])
    g = group(0, 0, [3, 3])
    g.samples[0].reward_parts = {"format": 1.0, "correct": 1.0}
    g.samples[1].reward_parts = {"format": 0.5, "correct": 0.0}
    rec.consumed([g], 0)
    rec.step_metrics({})
    rec.observe(TrainDone(1, 3.0), [])
    rec.close(4.0)
    (line,) = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert line["reward_parts"] == {"format": 0.75, "correct": 0.5}
    rows = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert [r["reward_parts"] for r in rows] == [
        {"format": 1.0, "correct": 1.0},
        {"format": 0.5, "correct": 0.0},
    ]
