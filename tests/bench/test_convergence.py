"""`dorarl bench convergence`: curves from a `dorarl train` run folder, time to an accuracy, the
bars, the config's checks, and (slow) an end-to-end run on a tiny model through `dorarl train`."""

import json

import pytest

from dorarl.bench.convergence import (
    ConvergenceConfig,
    _parse,
    check_bars,
    check_objective_bars,
    main,
    time_to_reach,
    version_to_reach,
)
from dorarl.cli import main as cli_main
from dorarl.config import ConfigError, load_config
from dorarl.report.convergence_plot import plot_convergence


def _curve(points: list[tuple[int, float, float]], wall: float) -> dict:
    return {
        "steps": [v for v, _, _ in points if v],
        "time_s": [t for v, t, _ in points if v],
        "reward_mean": [a for v, _, a in points if v],
        "eval": [{"version": v, "time_s": t, "accuracy": a} for v, t, a in points],
        "wall_time_s": wall,
    }


def test_time_to_reach_is_the_first_version_at_or_above():
    curve = _curve([(0, 0.0, 0.1), (5, 10.0, 0.3), (10, 20.0, 0.5), (15, 30.0, 0.45)], 30.0)
    assert time_to_reach(curve, 0.3) == 10.0
    assert time_to_reach(curve, 0.46) == 20.0
    assert time_to_reach(curve, 0.6) is None


def test_bars():
    sync = _curve([(0, 0.0, 0.1), (10, 40.0, 0.5)], 40.0)
    fast = _curve([(0, 0.0, 0.1), (5, 12.0, 0.3), (10, 25.0, 0.52)], 25.0)
    slow = _curve([(0, 0.0, 0.1), (10, 35.0, 0.40)], 35.0)
    good = {b["bar"].split()[1]: b for b in check_bars({"sync": sync, "dora_k1": fast})}
    assert good["final"]["met"] and good["time"]["met"]
    assert good["time"]["value"] == pytest.approx(25.0 / 40.0)
    bad = {b["bar"].split()[1]: b for b in check_bars({"sync": sync, "dora_k1": slow})}
    assert not bad["final"]["met"] and bad["final"]["value"] == pytest.approx(0.1)
    assert not bad["time"]["met"] and bad["time"]["value"] is None
    worse = _curve([(0, 0.0, 0.4), (10, 40.0, 0.3)], 40.0)  # sync got worse than the base
    void = {b["bar"].split()[1]: b for b in check_bars({"sync": worse, "dora_k1": slow})}
    assert void["time"]["met"] is None and "void" in void["time"]["note"]


def test_plot(tmp_path):
    curves = {"sync": _curve([(0, 0.0, 0.1), (10, 40.0, 0.5)], 40.0),
              "dora_k1": _curve([(0, 0.0, 0.1), (10, 25.0, 0.52)], 25.0)}  # fmt: skip
    out = plot_convergence(curves, tmp_path / "c.png")
    assert out.read_bytes()[:4] == b"\x89PNG" and out.stat().st_size > 10_000


def test_runs_use_dorarl_train_configs():
    cfg = load_config(
        ConvergenceConfig, None, ["steps=7", "dora_k=[1,3]", "train.tbs=4", "train.rbs=8"]
    )
    runs = dict(cfg.runs())
    assert list(runs) == ["sync", "dora_k1", "dora_k3"]
    assert all(c.steps == 7 and c.tbs == 4 and not c.progress for c in runs.values())
    assert (runs["sync"].mode, runs["sync"].K, runs["sync"].rbs) == ("sync", 0, 4)
    assert (runs["dora_k3"].mode, runs["dora_k3"].K) == ("dora", 3)


def test_objectives_are_dora_runs_at_the_first_k_with_their_losses():
    args = _parse(["--out", "x", "--objectives", "grpo,gspo, cispo,dr_grpo,rloo", "steps=9",
                   "dora_k=[3,1]", "train.sampling.max_new_tokens=16"])  # fmt: skip
    cfg = load_config(ConvergenceConfig, None, args.overrides)
    runs = dict(cfg.runs())
    assert list(runs) == ["grpo", "gspo", "cispo", "dr_grpo", "rloo"]
    assert all((c.mode, c.K, c.steps) == ("dora", 3, 9) for c in runs.values())
    losses = {name: c.trainer.loss for name, c in runs.items()}
    assert losses["grpo"] == cfg.train.trainer.loss  # the defaults: GRPO/DAPO
    assert losses["gspo"].ratio == "sequence" and losses["cispo"].kind == "cispo"
    assert losses["dr_grpo"].aggregation == "seq_sum_norm" and losses["rloo"].advantage == "rloo"
    assert _parse(["--out", "x", "--objectives=gspo"]).overrides == ["objectives=[gspo]"]


def test_objective_bars_name_the_first_version_reaching_the_accuracy():
    curves = {"grpo": _curve([(0, 0.0, 0.2), (10, 9.0, 0.85), (20, 19.0, 0.93)], 19.0),
              "gspo": _curve([(0, 0.0, 0.2), (20, 21.0, 0.88)], 21.0)}  # fmt: skip
    assert version_to_reach(curves["grpo"], 0.9) == 20
    bars = {b["bar"].split()[0]: b for b in check_objective_bars(curves, 0.9, 20)}
    assert bars["grpo"]["met"] and bars["grpo"]["value"] == 20
    assert not bars["gspo"]["met"] and bars["gspo"]["value"] is None


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("objectives=[grpo,ppo2]", "objectives: unknown objective"),
        ("train.forced_lengths.enabled=true", "running_sum, real lengths"),
        ("dora_k=[]", "dora_k: needs K values"),
        ("eval_every=0", "eval_every"),
        ("train.tbs=0", "tbs"),
    ],
)
def test_bad_settings(tmp_path, capsys, override, needle):
    with pytest.raises(ConfigError, match=needle.split(":")[0]):
        load_config(ConvergenceConfig, None, [override])
    assert cli_main(["bench", "convergence", "--out", str(tmp_path), override]) == 2
    assert needle.split(":")[0] in capsys.readouterr().err


def _tensorboard_tags(run_dir) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return set(events.Tags()["scalars"])


@pytest.mark.slow
@pytest.mark.usefixtures("shared_ray")  # both runs on one Ray
def test_end_to_end_tiny(tmp_path, tiny_model_dir, capsys):
    args = ["--out", str(tmp_path), "steps=2", "eval_every=1", "eval_prompts=8", "dora_k=[1]",
            f"train.model={tiny_model_dir}", "train.instances=1", "train.tbs=2", "train.rbs=4",
            "train.group_size=2", "train.engine.max_num_seqs=4", "train.sampling.max_new_tokens=12",
            "train.trainer.micro_batch_tokens=256"]  # fmt: skip
    assert main(args) == 0
    result = json.loads((tmp_path / "convergence.json").read_text())
    assert set(result["curves"]) == {"sync", "dora_k1"}
    for name, curve in result["curves"].items():
        assert [p["version"] for p in curve["eval"]] == [0, 2], name  # dorarl train's choice
        assert curve["steps"] == [1, 2] and curve["time_s"][0] > 0
        assert result["summary"][name]["pace"]["train"]["steps"] == 2
        assert (tmp_path / name / "metrics.jsonl").exists()
        grouped = {"rollout/reward_mean", "eval/eval_accuracy", "system/pace_train/paced_s"}
        assert grouped <= _tensorboard_tags(tmp_path / name)
    assert (tmp_path / "convergence.png").exists()
    assert len(result["bars"]["dora_k1"]) == 2
    assert "bars" in capsys.readouterr().out
