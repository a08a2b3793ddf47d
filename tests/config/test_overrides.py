"""One key=value override changes that key and no other, for every key of every command's config.

A section whose defaults come from a factory once rebuilt itself from its class defaults when
any of its keys was overridden (`trainer.device=cpu` turned `trainer.lr` 2e-4 into 1e-6); this
test walks every key `describe` lists, so a new key gets the same check.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Literal, get_args, get_origin

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dorarl.config import ConfigError, describe, flatten, load_config, to_dict, to_yaml
from dorarl.engine.vllm.config import vllm_missing
from dorarl.jobs.config import TrainConfig
from dorarl.simulate.config import SimulateConfig

CONFIGS = [TrainConfig, SimulateConfig]

# Keys no other value of which loads on a CPU machine without files: each with why.
UNCHANGEABLE = {
    "resume": "needs a checkpoint folder",
    "engine.max_versions": "needs engine.prefix_cache=off as well",
    "trainer.loss.tis_cap": "needs trainer.loss.ratio_base=proximal as well",
    "trainer.loss.norm_length": "needs trainer.loss.aggregation=seq_sum_norm as well",
    "trainer.loss.distill_coef": "needs trainer.teacher as well",
    "trainer.teacher": "needs trainer.loss.distill_coef > 0 as well (and a model folder)",
    "trainer.moe.route_replay": "needs engine.record_routes=true as well",
}
if vllm_missing():
    UNCHANGEABLE["engine.backend"] = "vllm: not installed here"


def leaf_types(cls: type, prefix: str = "") -> dict[str, Any]:
    """{dotted key: declared type} for every leaf field."""
    hints = typing.get_type_hints(cls)
    types: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            types.update(leaf_types(hints[f.name], f"{prefix}{f.name}."))
        else:
            types[f"{prefix}{f.name}"] = hints[f.name]
    return types


def other_values(ftype: Any, default: Any) -> list[Any]:
    """Values of `ftype` other than `default`, most ordinary first."""
    origin = get_origin(ftype)
    if origin is Literal:
        return [v for v in get_args(ftype) if v != default]
    if origin in (typing.Union, types.UnionType):
        options = [a for a in get_args(ftype) if a is not type(None)]
        values = [v for option in options for v in other_values(option, default)]
        return values + ([None] if default is not None else [])
    if ftype is bool:
        return [not default]
    if ftype is int:
        base = default if isinstance(default, int) else 1
        return [v for v in (base + 1, base * 2, base - 1, 1, 0, 4096) if v != default]
    if ftype is float:
        base = default if isinstance(default, float) else 0.5
        return [v for v in (base * 0.5, base * 1.5, 0.5, 0.25, 2.0) if v != default]
    if ftype is str:
        return [v for v in ("cuda", "bfloat16", "other") if v != default]
    if origin is list:
        return [[]] if default else [[1, 2]]
    if origin is dict:
        return [{}] if default else [{"other": 0.5}]
    return []


@functools.cache
def flat_defaults(cls: type) -> dict[str, Any]:
    return flatten(to_dict(load_config(cls)))


def changed_keys(cls: type, key: str, value: Any) -> set[str] | None:
    """Keys whose resolved value differs from the default after `key=value`; None if the
    value is refused (not every other value is valid for every key)."""
    text = yaml_scalar(value)
    try:
        config = load_config(cls, None, [f"{key}={text}"])
    except ConfigError:
        return None
    after, before = flatten(to_dict(config)), flat_defaults(cls)
    return {k for k in before if after.get(k) != before[k]}


def yaml_scalar(value: Any) -> str:
    import yaml

    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


@functools.cache
def cases(cls: type) -> list[tuple[str, Any]]:
    defaults = flat_defaults(cls)
    keys = [k for k, _, _ in describe(cls)]
    return [(k, other_values(leaf_types(cls)[k], defaults[k])) for k in keys]


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_key_overrides_alone(cls):
    exercised, stuck = 0, []
    for key, values in cases(cls):
        results = [(v, changed_keys(cls, key, v)) for v in values]
        accepted = [(v, changed) for v, changed in results if changed is not None]
        if not accepted:
            stuck.append(key)
            continue
        for value, changed in accepted:
            assert changed == {key}, f"{key}={value!r} also changed {sorted(changed - {key})}"
        exercised += 1
    assert set(stuck) <= set(UNCHANGEABLE), f"no other value loads for {stuck}"
    assert exercised >= 0.9 * len(describe(cls))


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_random_pairs_of_overrides_change_only_those_keys(data):
    key_values = [(k, v) for k, vs in cases(TrainConfig) for v in vs]
    picks = data.draw(st.lists(st.sampled_from(key_values), min_size=2, max_size=2))
    keys = {k for k, _ in picks}
    if len(keys) < 2:
        return
    try:
        config = load_config(TrainConfig, None, [f"{k}={yaml_scalar(v)}" for k, v in picks])
    except ConfigError:
        return  # some pairs are inconsistent together (rbs < tbs); the single test covers keys
    after, before = flatten(to_dict(config)), flat_defaults(TrainConfig)
    assert {k for k in before if after.get(k) != before[k]} <= keys


def test_help_shows_the_defaults_a_run_gets():
    shown = {key: default for key, default, _ in describe(TrainConfig)}
    helps = {key: help_ for key, _, help_ in describe(TrainConfig)}
    assert shown["trainer.lr"] == "None" and "by the model" in helps["trainer.lr"]
    assert shown["engine.max_model_len"] == "256"
    assert "trainer.temperature" not in shown  # derived from sampling.temperature


def test_the_sampling_temperature_sets_the_trainers():
    config = load_config(TrainConfig, None, ["sampling.temperature=0.7"])
    assert config.trainer.temperature == 0.7
    with pytest.raises(ConfigError, match="^trainer.temperature: follows sampling.temperature"):
        load_config(TrainConfig, None, ["trainer.temperature=0.7"])
    # a config.json written before the key was derived holds it as derived: accepted
    assert load_config(TrainConfig, None, ["trainer.temperature=1.0"]) == load_config(TrainConfig)


def test_printed_config_loads_back_to_the_same_config(tmp_path):
    config = load_config(TrainConfig, None, ["trainer.device=cuda", "K=3", "rbs=48"])
    path = tmp_path / "printed.yaml"
    path.write_text(to_yaml(config))
    assert load_config(TrainConfig, path) == config
