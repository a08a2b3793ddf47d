import dataclasses
import json
import math
import re

import numpy as np
import pytest

from dorarl.config import ConfigError
from dorarl.data.lengths import Z99, dapo_qwen32b, fit_lognormal
from dorarl.report.lanes import lane_subset
from dorarl.simulate.cli import build_config, main
from dorarl.simulate.presets import PRESETS, check_bars, non_rollout_ratio, reference_consistency
from dorarl.simulate.runs import run_modes


def shrink(cfg, instances, tbs, steps=3):
    """The preset's cost model and lengths on a small cluster (a short, cheap run)."""
    controller = dataclasses.replace(
        cfg.controller, instances=instances, tbs=tbs, rbs=2 * tbs, steps=steps
    )
    return dataclasses.replace(cfg, controller=controller, warmup_steps=1)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_validates_and_runs_without_dropping_groups(name):
    cfg = build_config(name, None, [])  # through the config loader: every key validated
    small = shrink(cfg, instances=2, tbs=4) if name != "local" else cfg
    results = run_modes(small, ["sync", "partial_rollout", "dora"], None)
    for mode, r in results.items():
        assert r["dropped_total"] == 0, mode
        assert r["steps"] == small.controller.steps
        assert r["consumed_tokens_per_s"] > 0
    assert results["partial_rollout"]["reprefill_tokens"] > 0
    assert results["dora"]["reprefill_tokens"] == 0


def test_overrides_apply_over_the_preset_and_are_validated():
    cfg = build_config("paper-64", None, ["controller.steps=2", "cost.decode_fixed_s=0.02"])
    assert cfg.controller.steps == 2 and cfg.cost.decode_fixed_s == 0.02
    assert cfg.controller.instances == 8  # the rest is the preset's
    assert cfg.cost.kv_bytes_per_token == 262_144
    with pytest.raises(ConfigError, match="cost.decode_fixed_s"):
        build_config("paper-64", None, ["cost.decode_fixed_s=-1"])


def test_paper_presets_scale_the_cluster():
    p64, p128 = PRESETS["paper-64"](), PRESETS["paper-128"]()
    assert p64.controller.instances * 4 == 32 and p128.controller.instances * 4 == 64
    assert p128.cost.train_per_token_s == pytest.approx(p64.cost.train_per_token_s / 2)
    assert p64.controller.group_size == 16 and p64.lengths.max_len == 20480


def test_lognormal_fit_recovers_mean_and_p99():
    dist = fit_lognormal(5000.0, 20480.0, max_len=10**7)
    assert dist.median * math.exp(dist.sigma**2 / 2) == pytest.approx(5000.0)
    assert dist.median * math.exp(Z99 * dist.sigma) == pytest.approx(20480.0)
    lengths = np.array([dist.group_lengths(0, g, 16) for g in range(3000)]).ravel()
    assert lengths.mean() == pytest.approx(5000, rel=0.05)
    assert np.percentile(lengths, 99) == pytest.approx(20480, rel=0.1)
    with pytest.raises(ConfigError, match="p99"):
        fit_lognormal(5000.0, 4000.0)


def test_dapo_fit_caps_at_the_published_limit():
    dist = dapo_qwen32b()
    assert dist.max_len == 20480 and 3000 < dist.median < 4500
    lengths = np.array([dist.group_lengths(1, g, 16) for g in range(1000)]).ravel()
    assert lengths.max() == 20480
    assert 0.003 < np.mean(lengths == 20480) < 0.03  # about 1% run to the limit


def test_bars_compare_against_the_paper_figures():
    results = {
        "sync": {"rollout_only_share": 0.60, "step_time_s": {"mean": 300.0}},
        "dora": {"rollout_only_share": 0.30, "step_time_s": {"mean": 200.0}},
    }
    bars = {b["name"]: b for b in check_bars("paper-64", results)}
    assert bars["sync rollout-only share"]["met"]  # 60% vs 65%
    assert not bars["dora rollout-only share"]["met"]  # 30% vs 12%
    assert bars["dora/sync step speedup"]["value"] == 1.5 and bars["dora/sync step speedup"]["met"]
    assert check_bars("moe-500b", results) == []


def test_the_paper_figures_imply_more_trainer_time_per_dora_step():
    # paper-64: 65% / 12% / 1.56x -> trainer side 0.88/1.56 of a sync step's 0.35
    assert non_rollout_ratio(0.65, 0.12, 1.56) == pytest.approx(0.88 / (1.56 * 0.35))
    assert non_rollout_ratio(0.5, 0.5, 1.0) == 1.0
    equal = {"sync": {"rollout_only_share": 0.65, "step_time_s": {"mean": 100.0}},
             "dora": {"rollout_only_share": 0.12, "step_time_s": {"mean": 35.0 / 0.88}}}  # fmt: skip
    found = reference_consistency("paper-64", equal)
    assert found["simulated_non_rollout_ratio"] == pytest.approx(1.0)  # same training per step
    assert found["paper_non_rollout_ratio"] == pytest.approx(1.612, abs=1e-3)
    assert found["paper_speedup_at_equal_training"] == pytest.approx(0.88 / 0.35)
    assert reference_consistency("paper-128", equal)["paper_non_rollout_ratio"] == pytest.approx(
        0.76 / (1.93 * 0.27)
    )
    assert reference_consistency("local", equal) == {}


def test_timelines_keep_at_most_64_lanes_evenly_spread():
    assert lane_subset(set(range(1, 11))) == set(range(1, 11))
    chosen = lane_subset(set(range(1, 513)))
    assert len(chosen) == 64 and {1, 512} <= chosen


def test_simulate_preset_writes_sim_json_and_timelines(tmp_path):
    args = ["--preset", "paper-64", "--out", str(tmp_path), "--modes", "sync,dora",
            "controller.instances=2", "controller.tbs=4", "controller.rbs=8",
            "controller.steps=3", "trace=true"]  # fmt: skip
    assert main(args) == 0
    doc = json.loads((tmp_path / "sim.json").read_text())
    assert doc["preset"] == "paper-64" and set(doc["modes"]) == {"sync", "dora"}
    for r in doc["modes"].values():
        keys = ("step_time_s", "rollout_only_share", "consumed_tokens_per_s", "slot_utilization",
                "staleness", "overhead_share", "reprefill_tokens", "migrations")  # fmt: skip
        assert all(k in r for k in keys)
        assert set(r["step_time_s"]) == {"mean", "median"}
    assert {b["name"] for b in doc["bars"]} >= {"dora/sync step speedup"}
    assert doc["speedups"]["dora/sync step"] > 1.0
    assert sorted(p.name for p in tmp_path.glob("timeline_*.png")) == [
        "timeline_dora.png",
        "timeline_sync.png",
    ]


def test_an_moe_preset_takes_the_imbalance_a_run_measured(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": 0, "moe_imbalance": 1.2}, {"step": 1, "moe_imbalance": 1.4}, {"step": 2}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "sim"
    small = ["controller.instances=2", "controller.tbs=4", "controller.rbs=8", "controller.steps=3"]
    args = ["--preset", "qwen3-30b-a3b-64", "--modes", "sync", "--out", str(out), *small]
    assert main([*args, "--expert-imbalance-from", str(run)]) == 0
    skewed = json.loads((out / "sim.json").read_text())
    assert skewed["config"]["cost"]["expert_imbalance"] == pytest.approx(1.3)
    assert main([*args, "cost.expert_imbalance=1.0"]) == 0
    even = json.loads((out / "sim.json").read_text())
    slower = skewed["modes"]["sync"]["step_time_s"]["mean"]
    assert slower > even["modes"]["sync"]["step_time_s"]["mean"]
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ConfigError, match="has no moe_imbalance"):
        main([*args, "--expert-imbalance-from", str(run)])
    with pytest.raises(ConfigError, match="cost.expert_imbalance: must be >= 1, got 0.5"):
        build_config("qwen3-30b-a3b-64", None, ["cost.expert_imbalance=0.5"])


def test_a_file_over_a_preset_takes_booleans_as_true_or_false(tmp_path):
    path = tmp_path / "sim.yaml"
    path.write_text("controller:\n  rollout:\n    filter_groups: yes\n")
    with pytest.raises(ConfigError, match="controller.rollout.filter_groups: write true or false"):
        build_config("paper-64", str(path), [])
    path.write_text("controller:\n  rollout:\n    filter_groups: true\n")
    assert build_config("paper-64", str(path), []).controller.rollout.filter_groups is True


def test_simulate_shows_the_paper_as_a_comparison_and_bars_only_when_asked(tmp_path, capsys):
    args = ["--preset", "paper-64", "--out", str(tmp_path), "--modes", "sync,dora",
            "controller.instances=2", "controller.tbs=4", "controller.rbs=8",
            "controller.steps=3"]  # fmt: skip
    assert main(args) == 0
    shown = " ".join(capsys.readouterr().out.split())  # the table's wrapped cells, one line
    assert "bar " not in shown and "MISSED" not in shown and " MET" not in shown
    assert "this simulation beside the paper" in shown
    assert re.search(r"dora is \d\.\d\dx faster per step here; the paper measured 1\.56x", shown)
    assert "the paper measured 65%" in shown and "the paper's figures imply 1.61x" in shown
    assert main([*args, "--bars"]) == 0
    bars = capsys.readouterr().out
    assert re.search(r"^bar dora/sync step speedup: .* (MET|MISSED)$", bars, re.M)
