"""`dorarl bench modes`: figures from recorder rows, bars, workload stats, the timeline from a
trace, the CLI's input errors, and (slow) one end-to-end run on a tiny model and workload."""

import json

import pytest
from rich.console import Console

from dorarl.bench.bars import check_bars, makespan_steps, staleness_ceiling
from dorarl.bench.modes import ModesConfig, main, sync_rollout_steps
from dorarl.bench.report import (
    bars_table,
    emulation_table,
    modes_table,
    pace_warnings,
    workload_table,
)
from dorarl.cli import main as cli_main
from dorarl.controller import ControllerConfig, OrchestratorConfig
from dorarl.data.lengths import LengthDist, length_stats
from dorarl.engine.vllm.config import vllm_missing
from dorarl.report.figures import mode_figures
from dorarl.report.timeline import plot_throughput, plot_timeline, read_trace
from dorarl.sim.cost import CostModel
from dorarl.sim.runtime import SimRuntime

MODE_KEYS = {
    "measured_steps", "warmup_steps", "step_time_s", "rollout_only_share", "train_time_s",
    "consumed_tokens", "consumed_tokens_per_s", "slot_utilization", "staleness", "overhead_share",
    "reprefill_tokens", "migrations", "pace", "per_step", "all_steps",
}  # fmt: skip


def _sim(tmp_path, mode: str, k: int = 1, steps: int = 6):
    cfg = ControllerConfig(mode=mode, K=k, rbs=4 if mode in ("sync", "one_step_off") else 8,
                           tbs=4, group_size=4, instances=2, slots=8,
                           steps=steps, orchestrator=OrchestratorConfig(rebalance_period_s=1.0),)  # fmt: skip
    cost = CostModel(train_fixed_s=0.5, train_per_token_s=1e-4)
    lengths = LengthDist(median=16, p99_ratio=12, max_len=300, prompt_len=16)
    sim = SimRuntime(cfg, cost, lengths, seed=0, out_dir=tmp_path / mode)
    sim.run()
    return sim.recorder.steps


def test_figures_leave_out_warmup_and_add_up(tmp_path):
    rows = _sim(tmp_path, "dora")
    fig = mode_figures(rows, warmup=2, num_instances=2)
    assert set(fig) == MODE_KEYS
    measured = rows[2:]
    wall = sum(r["step_time_s"] for r in measured)
    assert fig["measured_steps"] == 4
    assert fig["consumed_tokens_per_s"] == pytest.approx(
        sum(r["consumed_tokens"] for r in measured) / wall
    )
    assert sum(fig["staleness"].values()) == 4 * 4  # groups consumed by the measured steps
    assert all(0 <= int(s) <= 1 for s in fig["staleness"])
    assert 0 <= fig["rollout_only_share"] <= 1 and 0 < fig["slot_utilization"] <= 1
    assert fig["overhead_share"]["total"] == pytest.approx(
        sum(v for k, v in fig["overhead_share"].items() if k != "total"))  # fmt: skip
    assert fig["all_steps"]["steps"] == 6
    assert fig["pace"]["engine"]["steps"] == 0  # the simulator is not paced
    with pytest.raises(ValueError, match="no measured steps"):
        mode_figures(rows, warmup=6, num_instances=2)


def test_figures_and_table_carry_only_the_overheads_a_run_measured(tmp_path):
    rows = _sim(tmp_path, "dora")
    for r in rows:  # as the Ray runtime records them: no free_cache step to measure
        del r["overhead_s"]["free_cache"]
    fig = mode_figures(rows, warmup=1, num_instances=2)
    assert set(fig["overhead_share"]) == {"load_balance", "request_transfer", "total"}
    fig |= {"pace": {k: {"over_share": 0.0, "steps": 0} for k in ("engine", "train")},
            "paced_reliably": True, "load_avg_1min": [1.0, 1.0]}  # fmt: skip
    console = Console(record=True, width=250)
    console.print(modes_table({"modes": {"dora": fig}}))
    assert "/-" in console.export_text()


def test_sync_waits_for_rollout_more_than_dora(tmp_path):
    sync = mode_figures(_sim(tmp_path, "sync", k=0), warmup=1, num_instances=2)
    dora = mode_figures(_sim(tmp_path, "dora", k=3), warmup=1, num_instances=2)
    assert sync["rollout_only_share"] > dora["rollout_only_share"]
    assert set(sync["staleness"]) == {"0"}


def _figure(tps: float, rollout_only=0.1, overhead=0.01, over=(0.0, 0.0)) -> dict:
    pace = {"engine": {"over_share": over[0]}, "train": {"over_share": over[1]}}
    steps = 12  # alike, of 3 s each
    per_step = {"rollout_only_s": [3.0 * rollout_only] * steps,
                "train_time_s": [3.0 * (1 - rollout_only)] * steps}  # fmt: skip
    return {"consumed_tokens_per_s": tps, "rollout_only_share": rollout_only,
            "overhead_share": {"total": overhead}, "pace": pace,
            "step_time_s": {"mean": 3.0}, "per_step": per_step}  # fmt: skip


def test_bars_compare_the_named_dora_run():
    figures = {"sync": _figure(100, 0.6), "one_step_off": _figure(150),
               "partial_rollout": _figure(190), "dora_k1": _figure(210, 0.2, 0.06)}  # fmt: skip
    bars = {b["bar"]: b for b in check_bars(figures, "dora_k1")}
    assert bars["dora_k1 tokens/s / sync"]["value"] == pytest.approx(2.1)
    assert bars["dora_k1 tokens/s / sync"]["met"]
    assert bars["dora_k1 tokens/s / one_step_off"]["met"]  # 1.4 >= 1.3
    assert not bars["dora_k1 tokens/s / partial_rollout"]["met"]  # 1.105 < 1.15
    assert not bars["dora_k1 rollout-only share"]["met"]
    assert bars["sync rollout-only share"]["met"]
    assert not bars["dora_k1 overhead share"]["met"]
    assert all(b["paced_reliably"] for b in bars.values())
    # sync: R = 0.6 x 3 s, T = 1.2 s; K=1 allows a step every (R+T)/2 = 1.5 s at best
    assert bars["dora_k1 tokens/s / sync"]["k_bound"] == pytest.approx(2.0)
    assert bars["dora_k1 tokens/s / one_step_off"]["k_bound"] == pytest.approx(2.0 * 100 / 150)
    assert bars["dora_k1 rollout-only share"]["k_bound"] == pytest.approx(0.3 / 1.5)
    assert bars["dora_k1 overhead share"]["k_bound"] is None


@pytest.mark.parametrize(
    ("k", "rollout", "train", "speedup", "share"),
    [(1, 1.0, 0.5, 2.0, 1 / 3), (3, 1.0, 0.5, 3.0, 0.0), (2, 1.0, 0.5, 3.0, 0.0),
     (1, 1.0, 1.0, 2.0, 0.0), (1, 3.0, 1.0, 2.0, 0.5), (0, 1.0, 0.5, 1.0, 2 / 3)],
)  # fmt: skip
def test_staleness_bound_caps_speedup_and_floors_rollout_only_time(
    k, rollout, train, speedup, share
):
    most, least = staleness_ceiling(k, [rollout] * 12, [train] * 12)
    assert most == pytest.approx(speedup) and least == pytest.approx(share)


def test_dora_k1_in_the_simulator_stays_within_its_staleness_ceiling(tmp_path):
    figures = {
        name: mode_figures(_sim(tmp_path, mode, k, steps=12), 2, 2)
        for name, mode, k in (("sync", "sync", 0), ("dora_k1", "dora", 1))
    }
    figures["dora_k1"]["K"] = 1
    for name in ("one_step_off", "partial_rollout"):  # not under test here
        figures[name] = figures["sync"]
    bars = {b["bar"]: b for b in check_bars(figures, "dora_k1")}
    speedup = bars["dora_k1 tokens/s / sync"]
    assert 1.0 < speedup["value"] <= speedup["k_bound"] * 1.1
    share = bars["dora_k1 rollout-only share"]
    assert share["value"] >= share["k_bound"] * 0.9


def test_bars_say_when_a_mode_was_not_held_to_its_pace():
    figures = {"sync": _figure(100, 0.6), "one_step_off": _figure(150, over=(0.2, 0.0)),
               "partial_rollout": _figure(190), "dora_k1": _figure(210, over=(0.0, 0.5))}  # fmt: skip
    held = {b["bar"]: b["paced_reliably"] for b in check_bars(figures, "dora_k1")}
    assert held["sync rollout-only share"]
    assert not held["dora_k1 tokens/s / sync"] and not held["dora_k1 overhead share"]
    assert not held["dora_k1 tokens/s / one_step_off"]


def test_length_stats_and_makespan():
    stats = length_stats([1] * 98 + [50, 100])
    assert stats["median"] == 1 and stats["max"] == 100 and stats["n"] == 100
    assert stats["p99_over_median"] == pytest.approx(stats["p99"])
    assert makespan_steps([10, 1, 1, 1], slots=2) == 10
    assert makespan_steps([3, 3, 3, 3], slots=2) == 6
    assert makespan_steps([3, 3, 3, 3], slots=8) == 3


def test_default_workload_is_long_tailed_and_sync_rollout_is_its_longest_response():
    cfg = ModesConfig()
    dist = cfg.workload.dist()
    lengths = [n for g in range(2000) for n in dist.group_lengths(cfg.seed, g, cfg.group_size)]
    assert length_stats(lengths)["p99_over_median"] >= 10
    steps = sync_rollout_steps(cfg, 5)
    batch_max = [max(n for g in range(b * cfg.tbs, (b + 1) * cfg.tbs)
                     for n in dist.group_lengths(cfg.seed, g, cfg.group_size)) for b in range(5)]  # fmt: skip
    assert steps == pytest.approx(sum(batch_max) / 5 + 1)  # one batch fits the slots: + prefill


@pytest.mark.skipif(vllm_missing() is not None, reason="vllm is not installed here")
def test_a_vllm_bench_plans_what_its_engines_can_carry_out():
    """backend=vllm: every load from the trainer, KV relieved by migration only; each mode's
    engines are vLLM engines started eager."""
    from dorarl.config import load_config

    cfg = load_config(ModesConfig, None, ["backend=vllm"])
    assert cfg.engine().backend == "vllm" and cfg.engine().vllm.enforce_eager
    orchestrator = cfg.controller("dora", 1).orchestrator
    assert not orchestrator.p2p_weights and not orchestrator.engine_offload
    assert ModesConfig().controller("dora", 1).orchestrator.engine_offload


def test_multi_turn_workload_shows_no_forced_lengths():
    """Multi-turn episodes run at their natural lengths: the forced-length stats would
    describe a distribution nothing sampled from."""
    from dorarl.bench.modes import workload_stats
    from dorarl.config import load_config

    cfg = load_config(ModesConfig, None, ["workload.multi_turn=true", "workload.env_latency_s=2"])
    stats = workload_stats(cfg, dispatched=10)
    assert "sampled" not in stats and "dispatched" not in stats
    consumed = {"n": 4, "median": 9, "mean": 9.5, "p90": 12, "p99": 12, "max": 12, "p99_over_median": 1.3}  # fmt: skip
    console = Console(record=True, width=200)
    console.print(workload_table({"workload": stats | {"consumed": consumed}}))
    text = " ".join(console.export_text().split())  # the title wraps over the table's width
    assert "multiturn_sum episodes at their natural lengths, each tool call answered 2 s late" in text  # fmt: skip
    assert "forced" not in text and "consumed" in text
    assert "sampled" in workload_stats(load_config(ModesConfig, None, []), dispatched=10)


def test_timeline_from_a_recorder_trace(tmp_path):
    rows = _sim(tmp_path, "dora", k=1)
    trace = tmp_path / "dora" / "trace.json"
    view = read_trace(trace)
    assert sorted(view.versions) == [0, 1]
    assert {s.name for spans in view.versions.values() for s in spans} >= {"v0", "v1"}
    assert any(s.name.startswith("train step") for s in view.trainer)
    assert all(v >= 0 for changes in view.busy.values() for _, v in changes)
    out = plot_timeline(trace, tmp_path / "timeline.png", slots=8, title="dora")
    assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"
    figs = {
        "sync": mode_figures(_sim(tmp_path, "sync", k=0), 1, 2),
        "dora": mode_figures(rows, 1, 2),
    }
    runs = {"sync": _sim(tmp_path, "sync", k=0), "dora": rows}
    assert plot_throughput(runs, figs, tmp_path / "tp.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("workload.p99_ratio=5.0", "workload.p99_ratio: the benchmark's tail needs >= 10"),
        ("warmup_steps=10", "warmup_steps: must be in [0, steps)"),
        ("dora_k=[0]", "dora_k: needs K values >= 1"),
        ("workload.max_len=400", "workload.max_len: 400 leaves no room"),
        ("bogus=1", "unknown config key bogus"),
    ],
)
def test_bad_settings_exit_2_with_one_line(tmp_path, capsys, override, needle):
    rc = cli_main(["bench", "modes", "--out", str(tmp_path), "--quick", override])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and needle in err[0], err


@pytest.mark.slow
def test_end_to_end_tiny(tmp_path, tiny_model_dir, capsys):
    args = ["--out", str(tmp_path), f"model={tiny_model_dir}", "instances=2", "slots=4", "tbs=2",
            "group_size=2", "steps=3", "warmup_steps=1", "dora_k=[1]", "max_model_len=64",
            "workload.median=4.0", "workload.max_len=40"]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "device time (paced)" in printed and "partial_rollout" in printed and "bars" in printed
    result = json.loads((tmp_path / "modes.json").read_text())
    assert result["modes"].keys() == {"sync", "one_step_off", "partial_rollout", "dora_k1"}
    for name, fig in result["modes"].items():
        assert set(fig) >= MODE_KEYS, name
        assert fig["dropped_total"] == 0 and fig["measured_steps"] == 2
        assert fig["pace"]["engine"]["steps"] > 0 and fig["pace"]["train"]["steps"] == 2
        # paced: a step never takes less wall time than its training step's device time
        assert fig["step_time_s"]["mean"] >= fig["pace"]["train"]["paced_s"] / 2 * 0.99
        assert (tmp_path / name / "trace.json").exists()
        assert (tmp_path / f"timeline_{name}.png").exists()
    assert set(result["modes"]["sync"]["staleness"]) == {"0"}
    assert "free_cache" not in result["modes"]["dora_k1"]["overhead_share"]
    assert (tmp_path / "throughput.png").exists()
    emu = result["emulation"]
    assert emu["device"]["decode_step_s"] >= 2.0 * emu["calibration_real"]["decode_step_s"]
    assert result["workload"]["dispatched"]["n"] > 0 and result["config"]["steps"] == 3
    assert {b["bar"] for b in result["bars"]["dora_k1"]} >= {"dora_k1 tokens/s / sync"}
    console = Console(record=True, width=200)
    for table in (
        emulation_table(result),
        workload_table(result),
        modes_table(result),
        bars_table(result),
    ):
        console.print(table)
    assert "dora_k1" in console.export_text()
    assert all("took longer than their pace" in line for line in pace_warnings(result))
