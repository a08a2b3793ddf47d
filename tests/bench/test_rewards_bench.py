"""`dorarl bench rewards`: every runner scores every program right; the report has the
throughput, the latencies and each sandbox's overhead against the bare subprocess."""

import json

from dorarl.cli import main as cli_main
from dorarl.tasks.sandbox import bwrap_problem


def test_the_rewards_bench_scores_every_program_in_every_runner(tmp_path, capsys):
    assert cli_main(["bench", "rewards", "--out", str(tmp_path), "--programs", "12"]) == 0
    report = json.loads((tmp_path / "rewards.json").read_text())
    runners = {"bare subprocess", "unsafe_rlimits_only"} | (
        {"bwrap"} if bwrap_problem() is None else set()
    )
    assert set(report["contenders"]) == runners
    for result in report["contenders"].values():
        assert result["programs"] == result["passed"] == 12 and result["errors"] == 0
        assert result["programs_per_s"] > 0 and result["latency_median_ms"] > 0
    for name in ("bare subprocess", "unsafe_rlimits_only"):
        assert report["contenders"][name]["cpu_ms_per_program"] > 0
    assert report["contenders"]["bare subprocess"]["overhead_ms"] == 0.0
    assert report["cpu"] and "programs/s" in capsys.readouterr().out
