"""`dorarl report dashboard RUN`: a run folder's dashboard.png drawn again from its files."""

import json

from dorarl.cli import main


def test_report_dashboard_draws_a_run_folders_png(tmp_path, capsys):
    rows = [{"step": i, "version": i, "new_version": i + 1, "time_s": float(i + 1),
             "reward_mean": 0.1 * i, "loss": 0.1, "eval_accuracy": 0.2, "eval_version": i}
            for i in range(3)]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "summary.json").write_text(json.dumps({"mode": "dora", "K": 2}))
    assert main(["report", "dashboard", str(tmp_path)]) == 0
    assert (tmp_path / "dashboard.png").read_bytes()[:4] == b"\x89PNG"
    assert f"wrote {tmp_path / 'dashboard.png'} (3 steps)" in capsys.readouterr().out
    assert main(["report", "dashboard", str(tmp_path), "--out", str(tmp_path / "d.png")]) == 0
    assert (tmp_path / "d.png").exists()


def test_report_dashboard_refuses_a_folder_that_is_no_run(tmp_path, capsys):
    assert main(["report", "dashboard", str(tmp_path)]) == 2
    assert "not a run folder (no metrics.jsonl)" in capsys.readouterr().err
