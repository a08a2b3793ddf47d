"""read_curve: a run folder's metrics.jsonl as per-step rewards and per-version accuracies."""

import json

from dorarl.report.run_curve import read_curve


def test_read_curve_maps_each_evaluated_version_to_the_time_it_was_made(tmp_path):
    rows = [
        {"step": 0, "new_version": 1, "time_s": 2.0, "reward_mean": 0.1, "eval_accuracy": 0.2, "eval_version": 0},
        {"step": 1, "new_version": 2, "time_s": 3.5, "reward_mean": 0.3, "eval_accuracy": 0.4, "eval_version": 2},
        {"step": 2, "new_version": 3, "time_s": 5.0, "reward_mean": 0.5},
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    curve = read_curve(tmp_path)
    assert curve["steps"] == [1, 2, 3] and curve["wall_time_s"] == 5.0
    assert curve["eval"] == [
        {"version": 0, "time_s": 0.0, "accuracy": 0.2},
        {"version": 2, "time_s": 3.5, "accuracy": 0.4},
    ]
