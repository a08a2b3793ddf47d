import dataclasses
import json

import pytest

from dorarl.config import ConfigError
from dorarl.errors import UserInputError
from dorarl.simulate.cli import main
from dorarl.simulate.presets import PRESETS
from dorarl.simulate.validate import (
    COMPARED,
    bench_runs,
    compare,
    local_from_bench,
    recorded_bench,
    trim_bench,
)
from dorarl.simulate.whatif import plot_whatif, run_whatif


def hand_made_bench(step_s, tps):
    """A small `dorarl bench modes` modes.json: two runs on a 2-instance paced device."""
    figures = {
        name: {"K": k, "step_time_s": {"mean": step_s[name], "median": step_s[name]},
               "consumed_tokens_per_s": tps[name], "train_time_s": 0.3,
               "pace": {"train": {"excess_s": 0.0}, "engine": {"excess_s": 0.0}}}
        for name, k in (("sync", 0), ("dora_k2", 2))
    }  # fmt: skip
    return {
        "config": {"instances": 2, "slots": 8, "tbs": 4, "group_size": 4, "steps": 5,
                   "warmup_steps": 1, "rebalance_period_s": 1.0, "max_model_len": 320, "seed": 0,
                   "workload": {"median": 12.0, "p99_ratio": 10.0, "max_len": 200,
                                "group_corr": 0.5}},
        "emulation": {"device": {"decode_step_s": 0.01, "kv_token_s": 1e-6,
                                 "prefill_token_s": 1e-4, "train_fixed_s": 0.1,
                                 "train_token_s": 2e-4}},
        "modes": figures,
    }  # fmt: skip


# the hand-made bench's dora run: K=2 at the admission cap, RBS = (K + 1) x TBS
DORA_K2 = ["--modes", "sync,dora", "controller.K=2", "controller.rbs=12"]


def test_validation_records_step_time_and_throughput_per_run(tmp_path):
    bench = hand_made_bench({"sync": 1.0, "dora_k2": 1.0}, {"sync": 100.0, "dora_k2": 100.0})
    (tmp_path / "modes.json").write_text(json.dumps(bench))
    args = ["--bench", str(tmp_path / "modes.json"), *DORA_K2]
    assert main([*args, "--out", str(tmp_path / "v1")]) == 0
    doc = json.loads((tmp_path / "v1" / "sim.json").read_text())
    assert set(doc["modes"]) == {"sync", "dora"} and doc["modes"]["dora"]["K"] == 2
    predicted = {"sync": doc["modes"]["sync"], "dora_k2": doc["modes"]["dora"]}
    assert set(doc["validation"]["runs"]) == set(predicted)
    # now a bench that measured exactly 10% slower / 30% slower than the prediction
    for scale, within in ((1.1, True), (1.3, False)):
        step = {n: predicted[n]["step_time_s"]["mean"] * scale for n in predicted}
        tps = {n: predicted[n]["consumed_tokens_per_s"] / scale for n in predicted}
        (tmp_path / "modes.json").write_text(json.dumps(hand_made_bench(step, tps)))
        out = tmp_path / f"v{scale}"
        assert main([*args, "--out", str(out)]) == 0
        validation = json.loads((out / "sim.json").read_text())["validation"]
        assert validation["all_within"] is within
        row = validation["runs"]["sync"]["step_time_s.mean"]
        assert row["rel_error"] == pytest.approx(1 / scale - 1, rel=1e-6)


def test_local_preset_mirrors_the_bench_settings():
    bench = hand_made_bench({"sync": 1.0, "dora_k2": 1.0}, {"sync": 1.0, "dora_k2": 1.0})
    cfg = local_from_bench(bench)
    assert cfg.controller.instances == 2 and cfg.controller.slots == 8
    assert cfg.cost.decode_fixed_s == 0.01 and cfg.cost.train_per_token_s == 2e-4
    assert bench_runs(bench) == [("sync", "sync", 0), ("dora_k2", "dora", 2)]


def test_compare_flags_each_figure_against_the_tolerance():
    measured = {"a": {"step_time_s": {"mean": 10.0}, "consumed_tokens_per_s": 100.0}}
    predicted = {"a": {"step_time_s": {"mean": 8.0}, "consumed_tokens_per_s": 110.0}}
    row = compare(predicted, measured)["runs"]["a"]
    assert row["step_time_s.mean"]["rel_error"] == pytest.approx(-0.2)
    assert not row["step_time_s.mean"]["within"] and row["consumed_tokens_per_s"]["within"]


def test_a_bad_modes_json_is_a_user_error(tmp_path):
    (tmp_path / "modes.json").write_text(json.dumps({"modes": {}}))
    with pytest.raises(UserInputError, match="config"):
        main(["--bench", str(tmp_path / "modes.json"), "--out", str(tmp_path)])


def test_whatif_grid_and_heat_map(tmp_path):
    cfg = PRESETS["paper-64"]()
    controller = dataclasses.replace(cfg.controller, instances=2, tbs=8, rbs=16, steps=4)
    lengths = dataclasses.replace(cfg.lengths, median=1000.0, group_corr=0.0)
    small = dataclasses.replace(cfg, controller=controller, lengths=lengths)
    grid = run_whatif(small, ratios=(2.0, 20.0), ks=(1, 2))
    assert len(grid["cells"]) == 4 and all(c["dropped"] == 0 for c in grid["cells"])
    by = {(c["p99_ratio"], c["k"]): c for c in grid["cells"]}
    assert by[(20.0, 1)]["sync_step_s"] > 1.5 * by[(2.0, 1)]["sync_step_s"]  # the tail costs sync
    assert by[(20.0, 1)]["sync_step_s"] == by[(20.0, 2)]["sync_step_s"]  # one sync run per ratio
    assert all(c["dora_over_sync"] > 1.0 for c in grid["cells"])
    cell = by[(20.0, 2)]
    assert cell["dora_over_partial"] == pytest.approx(cell["partial_step_s"] / cell["dora_step_s"])
    assert plot_whatif(grid, tmp_path / "whatif.png").stat().st_size > 10_000


def test_local_preset_validates_against_the_recorded_bench_run(tmp_path):
    recorded = recorded_bench()
    assert {"sync", "one_step_off", "partial_rollout"} <= set(recorded["modes"])
    assert main(["--preset", "local", "--modes", "sync,dora", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "sim.json").read_text())
    assert set(doc["modes"]) == {"sync", "dora"}  # the modes named, dora at the preset's K=1
    runs = doc["validation"]["runs"]
    assert set(runs) == {"sync", "dora_k1"} and doc["validation"]["not_measured"] == {}
    for row in runs.values():  # the recorded run and the local preset agree within 15%
        assert all(row[key]["within"] for key in COMPARED), row


def test_an_override_takes_effect_on_the_local_preset_and_ends_its_validation(tmp_path, capsys):
    args = ["--preset", "local", "--modes", "sync,dora", "controller.K=2", "--out", str(tmp_path)]
    assert main(args) == 0
    doc = json.loads((tmp_path / "sim.json").read_text())
    assert set(doc["modes"]) == {"sync", "dora"} and doc["modes"]["dora"]["K"] == 2
    assert "validation" not in doc
    assert "not validated: the settings differ" in capsys.readouterr().out


def test_validate_compares_the_runs_the_bench_measured_at_the_settings_given(tmp_path):
    args = ["--validate", "--modes", "dora,one_step_off", "controller.K=3", "controller.rbs=32"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    validation = json.loads((tmp_path / "sim.json").read_text())["validation"]
    assert set(validation["runs"]) == {"dora_k3", "one_step_off"}
    k2 = ["--validate", "--modes", "dora,sync", "controller.K=2"]
    assert main([*k2, "--out", str(tmp_path / "k2")]) == 0  # sync is measured, dora K=2 not
    validation = json.loads((tmp_path / "k2" / "sim.json").read_text())["validation"]
    assert set(validation["runs"]) == {"sync"}
    assert "dora K=3 RBS 32" in validation["not_measured"]["dora"]
    with pytest.raises(UserInputError, match="^--validate: the bench measured none"):
        main(["--validate", "--modes", "dora", "controller.K=2", "--out", str(tmp_path / "x")])
    with pytest.raises(ConfigError, match="^--validate: .* drop --preset paper-64"):
        main(["--validate", "--preset", "paper-64", "--out", str(tmp_path / "y")])
    with pytest.raises(ConfigError, match="^--validate: a what-if grid"):
        main(["--validate", "--whatif", "--out", str(tmp_path / "z")])


def test_trim_keeps_what_the_local_preset_reads(tmp_path):
    bench = hand_made_bench({"sync": 1.0, "dora_k2": 1.0}, {"sync": 1.0, "dora_k2": 1.0})
    bench["modes"]["sync"]["migrations"] = 3  # not read by the preset: dropped
    trimmed = trim_bench(bench, source="test")
    assert "migrations" not in trimmed["modes"]["sync"]
    assert local_from_bench(trimmed) == local_from_bench(bench)


def _small_paper_64():
    cfg = PRESETS["paper-64"]()
    controller = dataclasses.replace(cfg.controller, instances=2, tbs=8, rbs=16, steps=4)
    lengths = dataclasses.replace(cfg.lengths, median=1000.0, group_corr=0.0)
    return dataclasses.replace(cfg, controller=controller, lengths=lengths)


def test_split_grid_moves_devices_between_rollout_and_the_trainer(tmp_path):
    from dorarl.simulate.whatif import plot_split, run_split_whatif

    small = _small_paper_64()  # 2 instances of 4 devices and a trainer of 32: 40 devices
    grid = run_split_whatif(small, shares=(0.25, 0.75), ks=(2,))
    assert grid["splits"] == ["8 / 32", "32 / 8"] and grid["runs"] == ["sync", "dora K=2"]
    assert all(c["rollout_devices"] + c["trainer_devices"] == 40 for c in grid["cells"])
    assert all(c["dropped"] == 0 for c in grid["cells"])
    by = {(c["split"], c["run"]): c for c in grid["cells"]}
    assert by[("8 / 32", "sync")]["speedup"] == 1.0  # the preset's own split
    # a trainer on 8 devices instead of 32: its per-token work takes 4x as long
    slow, fast = by[("32 / 8", "sync")]["train_s"], by[("8 / 32", "sync")]["train_s"]
    assert slow - small.cost.train_fixed_s == pytest.approx(4 * (fast - small.cost.train_fixed_s))
    assert by[("32 / 8", "sync")]["step_s"] != by[("8 / 32", "sync")]["step_s"]
    assert plot_split(grid, tmp_path / "split.png").stat().st_size > 10_000


def test_whatif_split_on_the_command_line(tmp_path, capsys):
    args = ["--whatif", "split", "--preset", "paper-64", "controller.instances=2",
            "controller.tbs=8", "controller.rbs=16", "controller.steps=3", "lengths.median=500",
            "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    doc = json.loads((tmp_path / "sim.json").read_text())
    assert doc["whatif"]["axis"] == "split" and (tmp_path / "whatif_split.png").is_file()
    assert "fastest split (rollout / trainer devices): sync at" in capsys.readouterr().out
    # --whatif without an axis is the tail grid, and takes no key=value after it for one
    assert main(["--whatif", "controller.steps=3", "--print-config"]) == 0
    assert "steps: 3" in capsys.readouterr().out
