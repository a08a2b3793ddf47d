"""Booleans are true/false only, in a file and on the command line: `yes`, `no`, `on`, `off`
stay words, which a bool key refuses in one line and a key of words takes as written."""

from __future__ import annotations

import pytest

from dorarl.config import ConfigError, load_config
from dorarl.config.yaml_text import key_lines, load_yaml
from dorarl.jobs.config import TrainConfig


def test_only_true_and_false_read_as_booleans():
    text = "a: yes\nb: off\nc: true\nd: FALSE\ne: On\nf: no\n"
    assert load_yaml(text) == {"a": "yes", "b": "off", "c": True, "d": False, "e": "On", "f": "no"}


def test_each_key_keeps_its_line():
    assert key_lines("steps: 3\ntrainer:\n\n  lr: 1.0\n") == {
        "steps": 1, "trainer": 2, "trainer.lr": 4,
    }  # fmt: skip


@pytest.mark.parametrize("word", ["yes", "no", "on", "off", "Yes", "y"])
def test_a_bool_key_refuses_yes_and_no_on_the_command_line(word):
    with pytest.raises(ConfigError) as refused:
        load_config(TrainConfig, None, [f"rollout.filter_groups={word}"])
    assert str(refused.value) == (
        f"rollout.filter_groups: write true or false, not {word!r} (command line)"
    )


def test_a_bool_key_refuses_yes_in_a_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  filter_groups: yes\n")
    with pytest.raises(ConfigError, match=rf"^rollout.filter_groups: write true or false, not 'yes' \({path}\)$"):  # fmt: skip
        load_config(TrainConfig, path)
    path.write_text("rollout:\n  filter_groups: true\n")
    assert load_config(TrainConfig, path).rollout.filter_groups is True


def test_words_stay_words_for_keys_of_words(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("checkpoint_every: off\ntask:\n  system_prompt: no\n")
    config = load_config(TrainConfig, path)
    assert config.checkpoint_every == "off" and config.task.system_prompt == "no"
