"""The run folder: `--out` is new, empty or the resumed run; `resume=RUN_DIR` alone takes that
run's config and folder; rows logged after the resumed checkpoint move to rolled_back/."""

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dorarl.cli import main as cli_main
from dorarl.config import ConfigError, load_config
from dorarl.jobs.config import TrainConfig
from dorarl.jobs.run_folder import (
    choose_out,
    config_source,
    open_run_folder,
    resume_command,
    roll_back,
    run_of,
)
from dorarl.report.tensorboard import ScalarLogger


def _checkpoint(folder, version):
    folder.mkdir(parents=True)
    state = {"version": version, "extra_state": {"version": version}}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    return folder


def _run_folder(path, versions=6, **keys):
    """A run folder as a run that reached `versions` leaves it (no weights: not needed)."""
    config = load_config(TrainConfig, overrides=[f"{k}={v}" for k, v in keys.items()])
    open_run_folder(path, config, resume_version=None)
    metrics = [{"step": v, "version": v, "new_version": v + 1, "reward_mean": v / 10}
               for v in range(versions)]  # fmt: skip
    trajs = [{"group_id": 2 * v + g, "train_version": v} for v in range(versions) for g in (0, 1)]
    for name, rows in (("metrics.jsonl", metrics), ("trajectories.jsonl", trajs)):
        (path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    logger = ScalarLogger(path)
    for row in metrics:
        logger.log(row)
    logger.close()
    for v in (2, 4, 6):
        _checkpoint(path / "checkpoints" / f"version_{v:05d}", v)
    return path


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _tensorboard_steps(path, tag="rollout/reward_mean"):
    acc = EventAccumulator(str(path / "tensorboard"))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def test_out_must_be_new_empty_or_the_resumed_run(tmp_path):
    run = _run_folder(tmp_path / "run")
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    assert choose_out(str(tmp_path / "new"), None, "dora") == tmp_path / "new"
    assert choose_out(str(tmp_path / "empty"), None, "dora") == tmp_path / "empty"
    with pytest.raises(ConfigError, match="is a file"):
        choose_out(str(tmp_path / "file"), None, "dora")
    with pytest.raises(ConfigError, match=r"not empty; .* resume="):
        choose_out(str(run), None, "dora")
    with pytest.raises(ConfigError, match="not empty"):  # resuming another run into it
        choose_out(str(run), str(_checkpoint(tmp_path / "elsewhere", 3)), "dora")
    assert choose_out(str(run), str(run), "dora") == run
    checkpoint = run / "checkpoints" / "version_00004"
    assert choose_out(str(run), str(checkpoint), "dora") == run
    assert choose_out(None, str(run), "dora") == run  # resume=RUN_DIR alone: its own folder
    assert choose_out(None, str(checkpoint), "dora") == run


@pytest.mark.parametrize("kind", ["file", "other_run"])
def test_a_taken_out_folder_is_one_line_exit_2_and_nothing_is_written(tmp_path, capsys, kind):
    if kind == "file":
        out = tmp_path / "taken"
        out.write_text("x")
    else:
        out = _run_folder(tmp_path / "taken")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    rc = cli_main(["train", "progress=false", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and f"--out {out}" in err[0], err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_bad_input_writes_no_run_folder(tmp_path, capsys, monkeypatch, tiny_model_dir):
    monkeypatch.chdir(tmp_path)
    assert cli_main(["train", "bogus=1"]) == 2
    data = tmp_path / "data.jsonl"
    data.write_text("{not json\n")
    args = ["train", f"model={tiny_model_dir}", "task.name=jsonl", f"task.path={data}"]
    assert cli_main(args) == 2  # the data is read before the folder is made
    assert cli_main([*args, "--out", str(tmp_path / "run")]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl"]


def test_resume_of_a_run_folder_takes_its_config(tmp_path):
    run = _run_folder(tmp_path / "run", steps=10, K=2, rbs=40)
    overrides = [f"resume={run}"]
    config = load_config(TrainConfig, config_source(None, overrides), overrides)
    assert (config.steps, config.K, config.rbs, config.resume) == (10, 2, 40, str(run))
    overrides = [f"resume={run}", "steps=12"]  # the command line still wins
    assert load_config(TrainConfig, config_source(None, overrides), overrides).steps == 12
    with pytest.raises(ConfigError, match="--config: resume="):
        config_source("other.yaml", overrides)
    assert config_source("other.yaml", ["steps=3"]) == "other.yaml"
    assert run_of(str(run / "checkpoints" / "version_00004")) == run
    assert run_of(str(_checkpoint(tmp_path / "loose", 2))) is None
    assert resume_command(tmp_path / "a b") == f"dorarl train resume='{tmp_path}/a b'"


def test_roll_back_moves_everything_after_the_checkpoint_aside(tmp_path):
    run = _run_folder(tmp_path / "run", versions=6)
    assert _tensorboard_steps(run) == [0, 1, 2, 3, 4, 5]
    moved = roll_back(run, 4)
    assert moved == {"metrics": 2, "trajectories": 4, "checkpoints": 1, "segments": 0}
    assert [m["new_version"] for m in _lines(run / "metrics.jsonl")] == [1, 2, 3, 4]
    assert {t["train_version"] for t in _lines(run / "trajectories.jsonl")} == {0, 1, 2, 3}
    aside = run / "rolled_back"
    assert [m["new_version"] for m in _lines(aside / "metrics.jsonl")] == [5, 6]
    assert {t["train_version"] for t in _lines(aside / "trajectories.jsonl")} == {4, 5}
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "version_00002",
        "version_00004",
    ]
    assert (aside / "checkpoints" / "version_00006").is_dir()
    assert _tensorboard_steps(run) == [0, 1, 2, 3]  # rebuilt from the rows kept
    assert roll_back(run, 4) == {"metrics": 0, "trajectories": 0, "checkpoints": 0, "segments": 0}


def test_roll_back_keeps_groups_filtered_before_the_checkpoint(tmp_path):
    # A checkpoint of version 4 is written while 3 is the newest the controller knows:
    # groups filtered until then (filtered_step <= 3) are not in its data position, groups
    # filtered later (filtered_step >= 4) are, and a resumed run samples them again.
    run = _run_folder(tmp_path / "run", versions=6)
    filtered = [{"group_id": 100 + s, "filtered": True, "filtered_step": s} for s in range(6)]
    with open(run / "trajectories.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in filtered))
    assert roll_back(run, 4)["trajectories"] == 4 + 2
    kept = [t for t in _lines(run / "trajectories.jsonl") if t.get("filtered")]
    assert [t["filtered_step"] for t in kept] == [0, 1, 2, 3]
    aside = [t for t in _lines(run / "rolled_back" / "trajectories.jsonl") if t.get("filtered")]
    assert [t["filtered_step"] for t in aside] == [4, 5]


def test_roll_back_moves_later_evaluations_aside_and_tensorboard_keeps_the_rest(tmp_path):
    run = _run_folder(tmp_path / "run", versions=6)
    evaluations = [{"version": v, "accuracy": v / 10} for v in (0, 2, 4, 6)]
    (run / "evaluations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evaluations))
    assert roll_back(run, 4)["evaluations"] == 1
    assert [r["version"] for r in _lines(run / "evaluations.jsonl")] == [0, 2, 4]
    assert [r["version"] for r in _lines(run / "rolled_back" / "evaluations.jsonl")] == [6]
    # each kept evaluation at the step that made its version (v0: the first step's start)
    assert _tensorboard_steps(run, "eval/eval_accuracy") == [0, 1, 3]
