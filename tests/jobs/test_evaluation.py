"""A run's evaluations are rows of evaluations.jsonl appended as they finish: the end of a
run never rewrites metrics.jsonl, and every reader joins the two by version."""

import json

import pytest

from dorarl.engine.config import EngineConfig
from dorarl.engine.vllm.config import vllm_missing
from dorarl.jobs.eval_actor import evaluator_engine
from dorarl.jobs.evaluation import finish_outputs
from dorarl.report.run_curve import read_curve


def _steps(path, n):
    rows = [{"step": i, "version": i, "new_version": i + 1, "time_s": float(i + 1),
             "reward_mean": 0.1 * i} for i in range(n)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_an_evaluation_finishing_after_its_step_appends_and_rewrites_no_metrics(tmp_path):
    metrics, evaluations = tmp_path / "metrics.jsonl", tmp_path / "evaluations.jsonl"
    _steps(metrics, 3)
    evals = {0: {"version": 0, "accuracy": 0.25, "mean@4": 0.3, "pass@4": 0.5},
             3: {"version": 3, "accuracy": 0.75, "mean@4": 0.6, "pass@4": 1.0}}  # fmt: skip
    before = metrics.read_bytes()
    evaluations.write_text(json.dumps(evals[0]) + "\n")  # v0's finished during the run
    early = evaluations.read_bytes()
    evaluations.write_text(early.decode() + json.dumps(evals[3]) + "\n")  # v3's after it
    scalars = finish_outputs(tmp_path, evals, title="dora")  # the run ends
    assert metrics.read_bytes() == before  # never rewritten
    assert evaluations.read_bytes().startswith(early)
    assert scalars == [
        {"step": 0, "eval_accuracy": 0.25, "eval_mean@4": 0.3, "eval_pass@4": 0.5},
        {"step": 2, "eval_accuracy": 0.75, "eval_mean@4": 0.6, "eval_pass@4": 1.0},
    ]  # TensorBoard's: each at the step that made its version (v0: the first step's start)
    assert [(p["version"], p["time_s"], p["accuracy"]) for p in read_curve(tmp_path)["eval"]] == [
        (0, 0.0, 0.25),
        (3, 3.0, 0.75),
    ]
    from dorarl.jobs.evaluation import with_evaluations  # one table's reader

    joined = with_evaluations(tmp_path)
    assert (joined[0]["eval_version"], joined[2]["eval_pass@4"]) == (0, 1.0)
    assert "eval_accuracy" not in joined[1]


def test_a_resumed_start_evaluated_again_wins_over_its_first_result(tmp_path):
    _steps(tmp_path / "metrics.jsonl", 2)
    rows = [{"version": 0, "accuracy": 0.1}, {"version": 2, "accuracy": 0.2},
            {"version": 2, "accuracy": 0.3}]  # fmt: skip
    (tmp_path / "evaluations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [p["accuracy"] for p in read_curve(tmp_path)["eval"]] == [0.1, 0.3]


def _jsonl_config(*overrides):
    from dorarl.config import load_config
    from dorarl.jobs.config import TrainConfig

    return load_config(TrainConfig, overrides=["task.name=jsonl", "task.path=d.jsonl", *overrides])


def test_the_start_says_the_held_out_count_and_warns_under_fifty_naming_task_eval_path():
    from dorarl.jobs.evaluation import held_out_line

    line, warning = held_out_line(_jsonl_config(), 3)  # 30 rows: a tenth held out
    assert line.startswith("held-out: 3 prompts (split off ") and line.endswith("d.jsonl)")
    assert "only 3 prompts" in warning and "task.eval_path=FILE" in warning
    assert "\n" not in warning
    _, capped = held_out_line(_jsonl_config("eval.max_prompts=20"), 300)
    assert "eval.max_prompts" in capped and "task.eval_path" not in capped
    line, none = held_out_line(_jsonl_config("task.eval_path=e.jsonl"), 80)
    assert line.startswith("held-out: 80 prompts (from ") and none is None


def test_a_plotted_accuracy_says_its_held_out_count(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from dorarl.report.convergence_plot import plot_convergence
    from dorarl.report.plots import plot_training_curve

    legends = []
    monkeypatch.setattr(plt, "close", lambda fig: legends.extend(
        t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()
    ))  # fmt: skip
    curve = {"steps": [1, 2], "time_s": [1.0, 2.0], "reward_mean": [0.1, 0.2],
             "eval": [{"version": 0, "time_s": 0.0, "accuracy": 0.3, "n": 3},
                      {"version": 2, "time_s": 2.0, "accuracy": 0.6, "n": 3}]}  # fmt: skip
    plot_training_curve(curve, tmp_path / "curve.png")
    assert "held-out accuracy (greedy, n=3)" in legends
    plot_convergence({"dora": curve}, tmp_path / "cmp.png")
    assert "dora (n=3)" in legends


@pytest.mark.skipif(vllm_missing() is not None, reason="vllm is not installed here")
def test_a_vllm_runs_evaluator_starts_eager_without_adapter_slots():
    """It evaluates now and then (no torch.compile start to pay back) and merges LoRA
    versions into the base (no vLLM adapter slots); our engine's evaluator is the engines'."""
    engine = EngineConfig(backend="vllm", max_versions=3)
    evaluator = evaluator_engine(engine)
    assert evaluator.backend == "vllm" and evaluator.vllm.enforce_eager
    assert evaluator.max_versions == 1 and not engine.vllm.enforce_eager
    ours = EngineConfig(max_num_seqs=4)
    assert evaluator_engine(ours) is ours
