"""Where a value came from: an error names the file or the command line as the value's own
source, an unknown key comes with the keys it was likely meant to be, and a relative path
resolves against the folder of the file that gives it or, on the command line, against the
working directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from dorarl.config import ConfigError, load_config
from dorarl.config.sources import nearest_keys
from dorarl.jobs.config import TrainConfig


@pytest.fixture
def gsm(tmp_path: Path) -> Path:
    path = tmp_path / "gsm.yaml"
    path.write_text("steps: 5\ntask:\n  name: jsonl\n  path: data/train.jsonl\n")
    return path


def test_a_typo_on_the_command_line_is_not_blamed_on_the_file(gsm):
    with pytest.raises(ConfigError) as refused:
        load_config(TrainConfig, gsm, ["stpes=3"])
    assert str(refused.value) == "unknown config key stpes (command line); did you mean steps?"


def test_a_typo_in_the_file_names_the_file(gsm):
    gsm.write_text(gsm.read_text() + "tbs_size: 4\n")
    with pytest.raises(ConfigError, match=rf"^unknown config key tbs_size \({gsm}\)"):
        load_config(TrainConfig, gsm, ["steps=3"])


def test_a_bad_value_names_its_own_source_beside_the_others(gsm, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(gsm.read_text() + "instances: 0\n")
    with pytest.raises(ConfigError, match=rf"^instances: must be >= 1, got 0 \({bad}\)$"):
        load_config(TrainConfig, bad, ["steps=3"])
    with pytest.raises(ConfigError, match=r"^K: must be >= 0, got -1 \(command line\)$"):
        load_config(TrainConfig, gsm, ["K=-1"])
    with pytest.raises(ConfigError, match=r"^rbs: must be >= tbs .*\(command line\)$"):
        load_config(TrainConfig, gsm, ["rbs=2"])  # a check between keys: the key it names


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("stpes", ["steps"]),
        ("lr", ["trainer.lr"]),
        ("trainer.lrr", ["trainer.lr"]),
        ("sampling.temprature", ["sampling.temperature"]),
        ("checkpoint_evry", ["checkpoint_every"]),
    ],
)
def test_the_nearest_keys_lead_with_the_one_meant(typed, meant):
    from dorarl.config.sources import dotted_keys

    assert nearest_keys(typed, dotted_keys(TrainConfig))[: len(meant)] == meant


def test_a_key_nothing_is_near_gets_no_suggestion():
    with pytest.raises(ConfigError, match=r"^unknown config key zzqx \(command line\)$"):
        load_config(TrainConfig, None, ["zzqx=1"])


def test_paths_in_a_file_resolve_against_its_folder(gsm, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path.parent)  # anywhere but the file's folder
    config = load_config(TrainConfig, gsm)
    assert config.task.path == str(tmp_path / "data" / "train.jsonl")
    up = tmp_path / "configs" / "run.yaml"
    up.parent.mkdir()
    up.write_text("model: ../models/mine\n")
    assert load_config(TrainConfig, up).model == str(tmp_path / "models" / "mine")


def test_paths_on_the_command_line_resolve_against_the_working_directory(
    gsm, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path / "data" if (tmp_path / "data").is_dir() else tmp_path)
    config = load_config(TrainConfig, gsm, ["task.path=mine.jsonl", "model=/abs/model"])
    assert config.task.path == str(tmp_path / "mine.jsonl") and config.model == "/abs/model"


def test_a_file_read_as_a_record_resolves_where_its_caller_says(gsm, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    config = load_config(TrainConfig, gsm, paths_from=elsewhere)
    assert config.task.path == str(elsewhere / "data" / "train.jsonl")
    assert load_config(TrainConfig).model is None  # no path given: nothing to resolve


def test_a_near_miss_in_the_file_names_the_file_its_line_and_the_key_meant(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("steps: 5\ntrainer:\n  learning_rate: 1.0e-5\n")
    with pytest.raises(ConfigError) as refused:
        load_config(TrainConfig, path)
    assert str(refused.value).startswith(
        f"unknown config key trainer.learning_rate ({path}) on line 3; did you mean trainer.lr "
    )
    with pytest.raises(ConfigError, match=r"\(command line\); did you mean trainer\.lr "):
        load_config(TrainConfig, None, ["trainer.learning_rate=1e-5"])


@pytest.mark.parametrize(
    ("typed", "meant"),
    [("trainer.learning_rate", "trainer.lr"), ("train_batch_size", "tbs")],
)
def test_a_key_meant_by_its_initials_is_suggested(typed, meant):
    from dorarl.config.sources import dotted_keys

    assert nearest_keys(typed, dotted_keys(TrainConfig))[0] == meant


def test_a_data_set_name_stays_as_given_where_no_such_path_exists(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["task.name=jsonl", "task.path=openai/gsm8k", "task.eval_path=held.jsonl"]
    config = load_config(TrainConfig, None, args)
    assert config.task.path == "openai/gsm8k"  # a name: no such folder here
    assert config.task.eval_path == str(tmp_path / "held.jsonl")  # a file's name: a path
    (tmp_path / "openai" / "gsm8k").mkdir(parents=True)
    assert load_config(TrainConfig, None, args).task.path == str(tmp_path / "openai" / "gsm8k")
