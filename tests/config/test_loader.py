from dataclasses import dataclass, field
from typing import Literal

import pytest

from dorarl.config import ConfigError, describe, load_config


@dataclass
class Inner:
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    amounts: dict[str, float] = field(default_factory=dict)


@dataclass
class Root:
    mode: Literal["sync", "dora"] = "dora"
    K: int = 1
    name: str | None = None
    inner: Inner = field(default_factory=Inner)

    def validate(self) -> None:
        if self.K < 0:
            raise ConfigError("K: must be >= 0")


def test_defaults_and_dotted_overrides():
    cfg = load_config(Root, overrides=["mode=sync", "inner.lr=0.5", "K=3", "inner.betas=[0.1,0.2]"])
    assert (cfg.mode, cfg.K, cfg.inner.lr, cfg.inner.betas) == ("sync", 3, 0.5, [0.1, 0.2])


def test_a_string_key_keeps_the_braces_typed_on_the_command_line():
    # YAML reads `{question}` as a mapping; a format template is what a string key meant
    assert load_config(Root, overrides=["name={question}"]).name == "{question}"
    assert load_config(Root, overrides=["name={question} Answer: {{}}"]).name == (
        "{question} Answer: {{}}"
    )
    assert load_config(Root, overrides=["inner={lr: 0.5}"]).inner.lr == 0.5  # sections still
    with pytest.raises(ConfigError, match="^K: expected int"):
        load_config(Root, overrides=["K={a: 1}"])


def test_a_mapping_key_from_the_command_line_and_from_yaml(tmp_path):
    """A dict key is typed item by item, set whole ({a: 1}) or one entry at a time (a.b.c=1),
    from the command line or a file; a bad entry names itself."""
    flow = load_config(Root, overrides=["inner.amounts={rollout: 1, learner: 0.5}"])
    assert flow.inner.amounts == {"rollout": 1.0, "learner": 0.5}
    assert all(isinstance(v, float) for v in flow.inner.amounts.values())
    dotted = load_config(Root, overrides=["inner.amounts.rollout=1", "inner.amounts.gpu_node=2"])
    assert dotted.inner.amounts == {"rollout": 1.0, "gpu_node": 2.0}
    path = tmp_path / "c.yaml"
    path.write_text("inner:\n  amounts: {rollout: 0.25}\n")
    assert load_config(Root, path, ["inner.amounts.more=1"]).inner.amounts == {
        "rollout": 0.25,
        "more": 1.0,
    }
    with pytest.raises(ConfigError, match=r"^inner\.amounts\.rollout: expected float, got 'x'"):
        load_config(Root, overrides=["inner.amounts={rollout: x}"])
    with pytest.raises(ConfigError, match="^inner.amounts: expected a mapping, got 'rollout'"):
        load_config(Root, overrides=["inner.amounts=rollout"])


def test_float_written_without_a_dot():
    assert load_config(Root, overrides=["inner.lr=3e-4"]).inner.lr == 3e-4


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("K: 2\ninner:\n  lr: 0.01\n")
    cfg = load_config(Root, path, ["K=4"])
    assert cfg.K == 4 and cfg.inner.lr == 0.01


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("bogus=1", "unknown config key bogus"),
        ("inner.nope=1", "unknown config key inner.nope"),
        ("mode=fast", "mode: must be one of"),
        ("K=abc", "K: expected int"),
        ("K=-1", "K: must be >= 0"),
        ("inner.lr=x", "inner.lr: expected float"),
        ("noequals", "not of the form key=value"),
    ],
)
def test_errors_name_the_key(override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(Root, overrides=[override])


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("K: 1\ninner: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+"):
        load_config(Root, path)


def test_describe_lists_dotted_keys():
    keys = [row[0] for row in describe(Root)]
    assert keys == ["mode", "K", "name", "inner.lr", "inner.betas", "inner.amounts"]


def test_every_problem_is_reported_one_line_each():
    with pytest.raises(ConfigError) as refused:
        load_config(Root, overrides=["bogus=1", "K=abc", "inner.lr=x", "inner.nope=2", "mode=fast"])
    lines = str(refused.value).splitlines()
    assert len(lines) == 5, lines
    for needle in ("unknown config key bogus", "K: expected int", "inner.lr: expected float",
                   "unknown config key inner.nope", "mode: must be one of"):  # fmt: skip
        assert sum(needle in line for line in lines) == 1, (needle, lines)


def test_checks_between_keys_run_only_over_good_values():
    with pytest.raises(ConfigError) as refused:
        load_config(Root, overrides=["K=-1"])
    assert str(refused.value).splitlines() == ["K: must be >= 0 (command line)"]
    with pytest.raises(ConfigError) as refused:
        load_config(Root, overrides=["K=-1", "inner.lr=x"])  # its check: not with a bad value
    assert str(refused.value).splitlines() == ["inner.lr: expected float, got 'x' (command line)"]
