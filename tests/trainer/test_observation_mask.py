"""Multi-turn samples: an environment's observation tokens are context, never trained on."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from test_packing import _assert_same_step, _groups, _step, _trainer

from dorarl.trainer import LossConfig, TrainerConfig


def _with_observations(groups, seed: int):
    """Mark random spans of each response as observations (logprob 0, as the engine has)."""
    rng = random.Random(seed)
    for group in groups:
        for s in group.samples:
            s.observed = [False] * len(s.response_ids)
            for start in range(1, len(s.response_ids), 5):
                for i in range(start, min(start + rng.randint(1, 3), len(s.response_ids))):
                    s.observed[i] = True
                    s.logprobs[i] = 0.0
    return groups


def _sampled_tokens(groups) -> int:
    return sum(s.observed.count(False) for g in groups for s in g.samples)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_packed_equals_padded_with_observations(tmp_path, single_thread, family, aggregation):
    config = TrainerConfig(loss=LossConfig(aggregation=aggregation), micro_batch_tokens=48)
    trainer = _trainer(family, tmp_path, config)
    groups = _with_observations(_groups(seed=3, n_groups=3, sizes=(2, 6), lengths=(1, 16)), 4)
    result = _assert_same_step(trainer, groups)
    assert result["packed"]["tokens"] == _sampled_tokens(groups)


def test_observation_tokens_do_not_reach_the_loss(tmp_path, single_thread):
    trainer = _trainer("llama", tmp_path, TrainerConfig(loss=LossConfig(kl_coef=0.0)))
    groups = _with_observations(_groups(seed=5, n_groups=3, sizes=(2, 5), lengths=(4, 16)), 6)
    base, grads = _step(trainer, groups, "shared_prompt")
    noisy = copy.deepcopy(groups)
    for s in (s for g in noisy for s in g.samples):
        s.logprobs = [-9.0 if o else lp for lp, o in zip(s.logprobs, s.observed, strict=True)]
    again, grads_again = _step(trainer, noisy, "shared_prompt")
    for key in ("loss", "ratio_mean", "kl_behavior", "tokens"):
        assert again[key] == pytest.approx(base[key], rel=1e-6, abs=1e-7), key
    for name, grad in grads.items():
        torch.testing.assert_close(grads_again[name], grad, rtol=1e-5, atol=1e-7)
    # The same noise on tokens the loss does see changes it: the check can fail.
    for s in (s for g in noisy for s in g.samples):
        s.observed = []
    unmasked, _ = _step(trainer, noisy, "shared_prompt")
    assert unmasked["tokens"] > base["tokens"] and unmasked["loss"] != pytest.approx(base["loss"])
