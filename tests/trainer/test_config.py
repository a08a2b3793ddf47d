"""Trainer settings load through the typed config loader and reject bad values by key."""

import pytest

from dorarl.config import ConfigError, load_config
from dorarl.trainer import TrainerConfig


def test_overrides_reach_nested_loss_settings():
    cfg = load_config(
        TrainerConfig,
        None,
        ["lr=0.0003", "loss.aggregation=seq_mean", "loss.ratio_base=proximal", "loss.tis_cap=2"],
    )
    assert cfg.lr == 3e-4 and cfg.loss.aggregation == "seq_mean" and cfg.loss.tis_cap == 2.0


@pytest.mark.parametrize(
    "override, key",
    [
        ("loss.tis_cap=2", "tis_cap"),
        ("loss.eps_low=1.5", "eps_low"),
        ("lr=0", "lr"),
        ("loss.dual_clip=0.5", "dual_clip"),
        ("temperature=0", "temperature"),
        ("micro_batch_tokens=-1", "micro_batch_tokens"),
        ("logits_chunk_tokens=0", "logits_chunk_tokens"),
        ("loss.aggregation=mean", "loss.aggregation"),
        ("loss.adv_eps=-1e-6", "adv_eps"),
        ("loss.adv_eps=nan", "adv_eps"),
    ],
)
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(TrainerConfig, None, [override])
