"""Every check of `TrainConfig`'s keys' relations names the full dotted key, at the root and
as a section."""

from __future__ import annotations

import pytest

from dorarl.bench.convergence import ConvergenceConfig
from dorarl.config import ConfigError, load_config
from dorarl.jobs.config import TrainConfig

CROSS_KEY_CASES = [
    (["rbs=2", "tbs=4"], "rbs"),
    (["group_size=9", "instances=1", "engine.max_num_seqs=8"], "group_size"),
    (["rollout.filter_groups=true", "group_size=1"], "rollout.filter_groups"),
    (["orchestrator.rebalance_period_s=.inf"], "orchestrator.rebalance_period_s"),
    (["trainer.loss.tis_cap=2"], "trainer.loss.tis_cap"),
    (["trainer.loss.overlong=soft"], "trainer.loss.overlong"),
    (["trainer.loss.overlong=soft", "sampling.max_new_tokens=32"], "trainer.loss.overlong_buffer"),
    (["forced_lengths.enabled=true", "forced_lengths.max_len=256"], "forced_lengths.max_len"),
    (["engine.num_blocks=1"], "engine.num_blocks"),
    (["engine.attention=cpp", "engine.dtype=bfloat16"], "engine.attention"),
    (["engine.device=cuda:1"], "engine.device"),
    (["weights.transport=collective", "engine.device=cuda"], "weights.transport"),
    (["ray.engine_resources={CPU: 1}"], "ray.engine_resources"),
    (["ray.trainer_resources={learner: 0}"], "ray.trainer_resources.learner"),
    (["task.name=jsonl"], "task.path"),
    (["runtime=sim", "resume=somewhere"], "resume"),
]
"""Checks of a key against others (not bounds): one case each, the key it must name."""


@pytest.mark.parametrize(("overrides", "key"), CROSS_KEY_CASES)
def test_relations_between_keys_name_the_full_key(overrides, key):
    with pytest.raises(ConfigError, match=rf"^{key}: .* \(command line\)$"):
        load_config(TrainConfig, None, overrides)


@pytest.mark.parametrize(("overrides", "key"), CROSS_KEY_CASES)
def test_as_a_section_they_name_the_key_under_it(overrides, key):
    """`dorarl bench convergence` holds a TrainConfig as `train`: the same checks name
    train.KEY (a component that names its own section is not named twice)."""
    nested = [f"train.{item}" for item in overrides]
    with pytest.raises(ConfigError, match=rf"^train\.{key}: "):
        load_config(ConvergenceConfig, None, nested)
