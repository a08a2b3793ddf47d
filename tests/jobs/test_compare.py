"""`dorarl report compare`: the table, JSON and PNG from run folders; bad folders in one line."""

import json
from pathlib import Path

import pytest

from dorarl.cli import main as cli_main
from dorarl.errors import UserInputError
from dorarl.jobs.compare import run_names, run_row
from dorarl.report.run_curve import read_curve


def _run_folder(path, mode, accuracies, wall, sampled=None):
    """A run folder of len(accuracies) steps, every version evaluated; `sampled`: each
    evaluation's mean@4 and pass@4 too (eval.samples=4)."""
    path.mkdir()
    rows = [
        {"step": i, "new_version": i + 1, "time_s": wall * (i + 1) / len(accuracies),
         "reward_mean": a, "eval_accuracy": a, "eval_version": i}
        for i, a in enumerate(accuracies)
    ]  # fmt: skip
    for row, (mean, passed) in zip(rows, sampled or [], strict=False):
        row |= {"eval_mean@4": mean, "eval_pass@2": passed / 2, "eval_pass@4": passed}
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"mode": mode, "K": 1, "wall_time_s": wall, "dropped_total": 0,
               "mean_step_time_s": wall / len(rows), "throughput_tokens_per_s": 10.0}  # fmt: skip
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def test_run_row_reads_first_and_last_held_out_accuracy(tmp_path):
    run = _run_folder(tmp_path / "a", "dora", [0.2, 0.5, 0.8], wall=30.0)
    row = run_row("a", run, read_curve(run))
    assert (row["mode"], row["steps"], row["eval_first"], row["eval_last"]) == ("dora", 3, 0.2, 0.8)
    assert row["wall_time_s"] == 30.0 and row["eval"] == {"0": 0.2, "1": 0.5, "2": 0.8}
    assert (row["eval_version_first"], row["eval_version_last"]) == (0, 2)


def test_a_run_evaluated_once_has_a_first_evaluation_and_no_last(tmp_path):
    run = _run_folder(tmp_path / "a", "dora", [0.2], wall=10.0)
    row = run_row("a", run, read_curve(run))
    assert (row["eval_first"], row["eval_last"], row["eval_version_last"]) == (0.2, None, None)


def _header(text):
    """The table's header cells (off a terminal: one line, none cut)."""
    (line,) = [line for line in text.splitlines() if line.startswith("┃")]
    return [cell.strip() for cell in line.strip("┃").split("┃")]


def test_the_table_shows_mean_and_pass_at_k_of_the_last_evaluation_uncut(tmp_path, capsys):
    a = _run_folder(tmp_path / "a", "dora", [0.2, 0.6], wall=20.0, sampled=[(0.1, 0.3), (0.4, 0.7)])
    b = _run_folder(tmp_path / "b", "sync", [0.2], wall=40.0)  # stopped after v0, greedy only
    out = tmp_path / "cmp.png"
    assert cli_main(["report", "compare", str(a), str(b), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert _header(text) == ["run", "mode", "steps", "wall s", "s/step", "rollout-only", "tok/s",
                             "held-out first", "held-out last", "mean@4 last", "pass@4 last",
                             "dropped"]  # fmt: skip
    (row_a,) = [line for line in text.splitlines() if line.startswith("│ a ")]
    assert "0.200 (v0)" in row_a and "0.600 (v1)" in row_a and "0.400" in row_a
    rows = json.loads(out.with_suffix(".json").read_text())
    assert rows[0]["sampled_last"] == {"mean@4": 0.4, "pass@4": 0.7}
    assert rows[0]["eval_sampled"]["0"] == {"mean@4": 0.1, "pass@2": 0.15, "pass@4": 0.3}
    assert rows[1]["eval_last"] is None and rows[1]["sampled_last"] == {}


def test_each_accuracy_shows_the_held_out_prompts_it_is_a_share_of(tmp_path, capsys):
    a = _run_folder(tmp_path / "a", "dora", [0.2, 0.6], wall=20.0)
    evaluations = [{"version": 0, "accuracy": 1 / 3, "n": 3.0}, {"version": 1, "accuracy": 2 / 3, "n": 3.0}]  # fmt: skip
    (a / "evaluations.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evaluations))
    assert run_row("a", a, read_curve(a))["eval_n"] == 3
    assert cli_main(["report", "compare", str(a), "--out", str(tmp_path / "c.png")]) == 0
    (row_a,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("│ a ")]
    assert "0.333 (v0, n=3)" in row_a and "0.667 (v1, n=3)" in row_a


def test_cli_writes_png_and_json(tmp_path, capsys):
    a = _run_folder(tmp_path / "a", "dora", [0.2, 0.6], wall=20.0)
    b = _run_folder(tmp_path / "b", "sync", [0.2, 0.4], wall=40.0)
    out = tmp_path / "figs" / "cmp.png"
    assert (
        cli_main(["report", "compare", str(a), str(b), "--names", "dora,sync", "--out", str(out)])
        == 0
    )
    assert out.stat().st_size > 1000
    rows = json.loads(out.with_suffix(".json").read_text())
    assert [r["name"] for r in rows] == ["dora", "sync"] and rows[1]["eval_last"] == 0.4
    assert "runs compared" in capsys.readouterr().out


def test_a_folder_without_metrics_is_refused_naming_it(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert cli_main(["report", "compare", str(tmp_path / "empty")]) == 2
    assert "empty: not a run folder" in capsys.readouterr().err


def test_names_must_match_the_folders():
    with pytest.raises(UserInputError, match="--names"):
        run_names([Path("a"), Path("b")], "x")
