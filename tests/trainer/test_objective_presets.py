"""The named objectives: each sets exactly its keys over the defaults (or the user's loss),
every combination passes the loss's checks, and an unknown name is refused naming the key."""

import dataclasses

import pytest

from dorarl.config import ConfigError
from dorarl.trainer.config import LossConfig
from dorarl.trainer.objective_presets import OBJECTIVES, check_objectives, objective_loss


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_each_objective_sets_its_keys_and_keeps_the_rest(name):
    base = LossConfig(kl_coef=0.01, entropy_coef=0.001)
    loss = objective_loss(name, base)
    for key, value in OBJECTIVES[name].items():
        assert getattr(loss, key) == value, key
    untouched = {f.name for f in dataclasses.fields(LossConfig)} - set(OBJECTIVES[name])
    for key in untouched:
        assert getattr(loss, key) == getattr(base, key), key


def test_the_objectives_differ_in_what_the_loss_reads():
    read = {name: (objective_loss(name, LossConfig())) for name in OBJECTIVES}
    assert read["grpo"] == LossConfig()
    assert (read["gspo"].ratio, read["gspo"].aggregation) == ("sequence", "seq_mean")
    assert read["gspo"].eps_high < 0.01  # GSPO's sequence clip range, not the token one
    assert read["cispo"].kind == "cispo"
    assert (read["dr_grpo"].aggregation, read["dr_grpo"].normalize_std) == ("seq_sum_norm", False)
    assert read["rloo"].advantage == "rloo" and read["reinforce_pp"].advantage == "reinforce_pp"
    assert len({repr(loss) for loss in read.values()}) == len(OBJECTIVES)


def test_unknown_objective_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"^objectives: unknown objective 'ppo2'"):
        check_objectives(["grpo", "ppo2"], "objectives")
    with pytest.raises(ConfigError, match="objective"):
        objective_loss("nope", LossConfig())
