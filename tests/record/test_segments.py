"""A resumed run's summary.json and trace.json describe the whole run: real recorders write
two or three segments into one folder, as stopped, killed and resumed processes leave it."""

import json

import pytest

from dorarl.controller import Dispatch, SampleDone, Start, Train, TrainDone
from dorarl.data import Group, Sample
from dorarl.jobs.run_folder import roll_back
from dorarl.record import Recorder
from dorarl.record.segments import end_segment, open_segment, run_books, write_run_records
from dorarl.report.run_curve import read_curve

EPOCH = 1_700_000_000.0


def _group(gid, version, tokens):
    sample = Sample(gid, 0, prompt_id=gid, prompt_ids=[1], response_ids=[7] * tokens,
                    versions=[version] * tokens, reward=1.0)  # fmt: skip
    return Group(gid, gid, version, [sample])


def _segment(out, start, steps, *, stale=0, close=True, fallbacks=()):
    """A segment from version `start`: per step one group of 4 tokens sampled `stale`
    versions back (1 s of rollout, then 1 s of training, on 1 instance of 2 slots); not
    closed: killed after its last step."""
    folder = open_segment(out, start, instances=1, slots=2)
    rec = Recorder(out, mode="dora", k=1, num_instances=1, slots_per_instance=2,
                   first_version=start, records_dir=folder, trajectories=close)  # fmt: skip

    def dispatch(i):
        gid = 100 * start + i
        return [Dispatch(gid, gid, start + i - stale, 0, (0,))] if i < steps else []

    rec.engine_setup(0, {"attention": "torch", "fast_path_fallbacks": list(fallbacks)})
    rec.observe(Start(0.0), dispatch(0))
    for i in range(steps):
        v, t, gid = start + i, 2.0 * i, 100 * start + i
        rec.observe(SampleDone(gid, 0, 0, 4, t + 1.0), [Train((gid,), v)])
        rec.consumed([_group(gid, v - stale, 4)], v)
        rec.observe(TrainDone(v + 1, t + 2.0), dispatch(i + 1))
    if close:
        summary = rec.close(2.0 * steps + 0.5)
        summary["eval"] = {str(start): 0.1 * start, str(start + steps): 0.1 * (start + steps)}
        summary["env_errors"] = steps  # as the runtime adds it: one failed episode a step
        end_segment(folder, summary, "stopped" if start == 0 else "finished", EPOCH + 10 * start)
    return folder  # killed: what it leaves are the metrics rows it flushed, step by step


def _trace(out):
    return json.loads((out / "trace.json").read_text())["traceEvents"]


def test_summary_and_trace_of_a_stopped_then_resumed_run_cover_both_segments(tmp_path):
    _segment(tmp_path, 0, 2)
    one = write_run_records(tmp_path)
    assert (one["steps"], one["wall_time_s"], one["segments"][0]["ended"]) == (2, 4.5, "stopped")
    _segment(tmp_path, 2, 3, stale=1)
    summary = write_run_records(tmp_path)

    assert summary["steps"] == 5 and summary["consumed"] == summary["dispatched"] == 5
    assert summary["dropped_total"] == 0 and summary["in_flight_at_end"] == 0
    assert summary["wall_time_s"] == 4.5 + 6.5  # each segment's run time, not the gap
    assert summary["consumed_tokens"] == 20
    assert summary["throughput_tokens_per_s"] == pytest.approx(20 / 11.0)
    assert summary["mean_step_time_s"] == 2.0 and summary["rollout_only_share"] == 0.5
    assert summary["staleness"] == {"0": 2, "1": 3}
    assert summary["eval"] == {"0": 0.0, "2": 0.2, "5": 0.5}
    assert summary["env_errors"] == 5  # the segments' failed episodes, summed
    assert (summary["eval_accuracy_first"], summary["eval_accuracy_last"]) == (0.0, 0.5)
    assert (summary["eval_version_first"], summary["eval_version_last"]) == (0, 5)
    ends = [
        (s["start_version"], s["end_version"], s["steps"], s["ended"]) for s in summary["segments"]
    ]
    assert ends == [(0, 2, 2, "stopped"), (2, 5, 3, "finished")]
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    # one segment's own records stay in its folder
    own = json.loads((tmp_path / "segments" / "001" / "summary.json").read_text())
    assert own["steps"] == 3 and own["ended"] == "finished" and own["staleness"] == {"1": 3}

    # every step on one timeline, the second segment 20 s (of wall clock) after the first
    trace = _trace(tmp_path)
    steps = {e["name"]: e["ts"] for e in trace if e["name"].startswith("train step")}
    assert list(steps) == [f"train step {s} (v{s} -> v{s + 1})" for s in range(5)]
    assert steps["train step 1 (v1 -> v2)"] == 3.0e6 and steps["train step 2 (v2 -> v3)"] == 21.0e6
    markers = [e for e in trace if e.get("s") == "g"]
    assert [(m["ts"], m["args"]["ended"]) for m in markers] == [(0.0, "stopped"),
                                                              (20.0e6, "finished")]  # fmt: skip
    names = [e for e in trace if e["name"] == "process_name"]
    assert len(names) == 2  # the trainer and instance 0, named once

    curve = read_curve(tmp_path)  # the compare plot's clock runs on across segments
    assert curve["time_s"] == [2.0, 4.0, 4.5 + 2.0, 4.5 + 4.0, 4.5 + 6.0]


def test_a_run_evaluated_only_at_its_start_reports_that_evaluation_as_first_only(tmp_path):
    folder = _segment(tmp_path, 0, 2)
    own = json.loads((folder / "summary.json").read_text())
    own["eval"] = {"0": 0.25}  # stopped before the evaluation of v2 finished
    (folder / "summary.json").write_text(json.dumps(own))
    summary = write_run_records(tmp_path)
    assert (summary["eval_version_first"], summary["eval_accuracy_first"]) == (0, 0.25)
    assert "eval_accuracy_last" not in summary and "eval_version_last" not in summary


def test_a_killed_segment_keeps_the_others_and_its_kept_steps_count(tmp_path):
    _segment(tmp_path, 0, 2)
    write_run_records(tmp_path)
    _segment(tmp_path, 2, 2, close=False)  # killed after making v4 (say, checkpointed)
    roll_back(tmp_path, 3)  # resumed from v3: its second step is rolled back, not the first
    _segment(tmp_path, 3, 1)
    summary = write_run_records(tmp_path)

    assert [(s["start_version"], s["end_version"], s["ended"]) for s in summary["segments"]] == [
        (0, 2, "stopped"),
        (2, 3, "killed"),
        (3, 4, "finished"),
    ]
    assert summary["steps"] == 4 and summary["consumed_tokens"] == 16
    assert summary["wall_time_s"] == 4.5 + 2.0 + 2.5  # the killed one: to its last kept step
    assert summary["consumed"] == 3  # only closed segments' books count groups
    trace = _trace(tmp_path)
    assert sum(e["name"].startswith("train step") for e in trace) == 3  # killed: no trace
    assert [e["args"]["ended"] for e in trace if e.get("s") == "g"] == [
        "stopped",
        "killed",
        "finished",
    ]


def test_a_resume_from_an_older_version_moves_later_segments_aside(tmp_path):
    _segment(tmp_path, 0, 2)
    _segment(tmp_path, 2, 2)
    assert roll_back(tmp_path, 2)["segments"] == 1
    assert (tmp_path / "rolled_back" / "segments" / "001" / "summary.json").is_file()
    _segment(tmp_path, 2, 1)
    summary = write_run_records(tmp_path)
    assert [s["segment"] for s in summary["segments"]] == [0, 1]
    assert summary["steps"] == 3 and summary["wall_time_s"] == 4.5 + 2.5
    assert roll_back(tmp_path, 2)["segments"] == 1
    assert (tmp_path / "rolled_back" / "segments" / "001-1").is_dir()  # the earlier one kept


def test_the_runs_summary_keeps_its_engines_and_every_segments_fast_path_fallbacks(tmp_path):
    fell_back = {"path": "triton", "error": "RuntimeError: PTX assembly failed"}
    _segment(tmp_path, 0, 2, fallbacks=[fell_back])
    _segment(tmp_path, 2, 1)
    summary = write_run_records(tmp_path)
    assert summary["engines"] == {"0": {"attention": "torch", "fast_path_fallbacks": []}}
    assert summary["fast_path_fallbacks"] == [{"segment": 0, "instance": 0, **fell_back}]


def test_the_runs_evaluations_come_from_its_evaluations_file_joined_by_version(tmp_path):
    for start, steps in ((0, 2), (2, 2)):
        folder = _segment(tmp_path, start, steps)
        own = json.loads((folder / "summary.json").read_text())
        del own["eval"]  # a segment's summary holds no evaluations: the run's file does
        (folder / "summary.json").write_text(json.dumps(own))
    rows = [{"version": 0, "accuracy": 0.1}, {"version": 2, "accuracy": 0.2, "mean@2": 0.3},
            {"version": 2, "accuracy": 0.4, "mean@2": 0.5},  # the resumed start, again
            {"version": 4, "accuracy": 0.6}, {"version": 9, "accuracy": 0.9}]  # fmt: skip
    (tmp_path / "evaluations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = write_run_records(tmp_path)
    assert summary["eval"] == {"0": 0.1, "2": 0.4, "4": 0.6}  # v9: not in the history
    assert summary["eval_sampled"] == {"2": {"mean@2": 0.5}}
    assert (summary["eval_version_last"], summary["eval_accuracy_last"]) == (4, 0.6)


def test_a_segment_killed_after_its_stop_checkpoint_counts_the_books_it_left(tmp_path):
    """Stopped with 2 groups queued, resumed (carrying them), killed after its own stop
    checkpoint (which kept the run's counts), resumed again: the whole run still adds up."""
    _segment(tmp_path, 0, 2)
    stopped = json.loads((tmp_path / "segments" / "000" / "summary.json").read_text())
    stopped |= {"dispatched": 4, "completed": 4, "queued_at_end": 2}  # 2 left queued
    (tmp_path / "segments" / "000" / "summary.json").write_text(json.dumps(stopped))
    killed = {"dispatched": 5, "completed": 4, "consumed": 2, "filtered": 0, "carried_in": 2,
              "dropped": {"in_flight_at_stop": 1}}  # fmt: skip  # and 4 queued at its stop
    _segment(tmp_path, 2, 1, close=False)
    books = run_books(run_books({}, stopped), killed)  # what its stop checkpoint held
    folder = open_segment(tmp_path, 3, instances=1, slots=2, resumed_books=books)
    rec = Recorder(tmp_path, mode="dora", k=1, num_instances=1, slots_per_instance=2,
                   first_version=3, records_dir=folder)  # fmt: skip
    for gid in (90, 91, 92, 93):
        rec.carried(gid)
    rec.observe(Start(0.0), [Train((90, 91, 92, 93), 3)])
    rec.consumed([_group(gid, 2, 4) for gid in (90, 91, 92, 93)], 3)
    rec.observe(TrainDone(4, 1.0), [])
    end_segment(folder, rec.close(1.5), "finished", EPOCH + 50)
    summary = write_run_records(tmp_path)
    assert summary["carried_in"] == 2 + 4 and summary["dropped_total"] == 1
    ends = summary["queued_at_end"] + summary["in_flight_at_end"] + summary["dropped_total"]
    assert summary["dispatched"] == summary["consumed"] + summary["filtered"] + ends


def test_the_runs_summary_says_how_many_held_out_prompts_its_accuracies_are_shares_of(tmp_path):
    _segment(tmp_path, 0, 2)
    rows = [{"version": 0, "accuracy": 1 / 3, "n": 3.0}, {"version": 2, "accuracy": 2 / 3, "n": 3}]
    (tmp_path / "evaluations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert write_run_records(tmp_path)["eval_n"] == 3


def test_the_runs_summary_keeps_the_start_up_of_its_last_segment(tmp_path):
    for start, steps, total in ((0, 2, 30.0), (2, 1, 12.5)):
        folder = _segment(tmp_path, start, steps)
        own = json.loads((folder / "summary.json").read_text())
        own["startup"] = {"total_s": total, "phases_s": {"ray": total}, "slowest": "ray"}
        (folder / "summary.json").write_text(json.dumps(own))
    assert write_run_records(tmp_path)["startup"]["total_s"] == 12.5  # this process's start
