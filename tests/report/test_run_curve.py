"""read_curve: a run folder's metrics.jsonl as per-step rewards and per-version accuracies,
the one curve both plots of a run draw."""

import json

import pytest

from dorarl.report.run_curve import read_curve


def test_read_curve_maps_each_evaluated_version_to_the_time_it_was_made(tmp_path):
    rows = [
        {"step": 0, "version": 0, "new_version": 1, "time_s": 2.0, "reward_mean": 0.1, "eval_accuracy": 0.2, "eval_version": 0},
        {"step": 1, "version": 1, "new_version": 2, "time_s": 3.5, "reward_mean": 0.3, "eval_accuracy": 0.4, "eval_version": 2},
        {"step": 2, "version": 2, "new_version": 3, "time_s": 5.0, "reward_mean": 0.5},
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    curve = read_curve(tmp_path)
    assert curve["steps"] == [1, 2, 3] and curve["wall_time_s"] == 5.0
    assert curve["eval"] == [
        {"version": 0, "time_s": 0.0, "accuracy": 0.2},
        {"version": 2, "time_s": 3.5, "accuracy": 0.4},
    ]


def test_a_run_resumed_into_a_new_folder_evaluates_its_start_at_time_zero(tmp_path):
    rows = [
        {"step": 1, "version": 1, "new_version": 2, "time_s": 1.5, "reward_mean": 0.1, "eval_accuracy": 0.2, "eval_version": 1},
        {"step": 2, "version": 2, "new_version": 3, "time_s": 3.0, "reward_mean": 0.3, "eval_accuracy": 0.4, "eval_version": 3},
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_curve(tmp_path)["eval"] == [
        {"version": 1, "time_s": 0.0, "accuracy": 0.2},
        {"version": 3, "time_s": 3.0, "accuracy": 0.4},
    ]


def test_the_reward_curve_and_the_compare_plot_draw_each_point_at_the_same_version(
    tmp_path, monkeypatch
):
    from matplotlib.axes import Axes

    from dorarl.jobs.evaluation import finish_outputs
    from dorarl.record.evaluations import append_evaluation
    from dorarl.report.convergence_plot import plot_convergence

    rows = [{"step": i, "version": i, "new_version": i + 1, "time_s": float(i + 1),
             "reward_mean": 0.1 * (i + 1)} for i in range(3)]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = {v: {"version": v, "accuracy": a} for v, a in ((0, 0.1), (2, 0.4), (3, 0.6))}
    for result in evals.values():  # as the evaluator's results finish during the run
        append_evaluation(tmp_path / "evaluations.jsonl", result)
    drawn, plot = [], Axes.plot

    def spy(ax, *args, **kwargs):  # the (x, y) of every line either figure draws
        drawn.append((list(args[0]), list(args[1])))
        return plot(ax, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", spy)
    finish_outputs(tmp_path, evals, title="dora")  # reward_curve.png, as `dorarl train` ends
    reward, accuracy = drawn
    drawn.clear()
    plot_convergence({"run": read_curve(tmp_path)}, tmp_path / "compare.png")
    by_version, _, reward_by_step, _ = drawn
    assert accuracy == by_version == ([0, 2, 3], [0.1, 0.4, 0.6])  # v0 at 0, v3 at 3
    assert reward == reward_by_step == ([1, 2, 3], [0.1, 0.2, pytest.approx(0.3)])
