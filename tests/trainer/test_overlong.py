"""Overlong handling (DAPO): masking truncated responses and the soft length penalty."""

import pytest

from dorarl.config import ConfigError, load_config
from dorarl.data import Group, Sample, Turn
from dorarl.jobs.config import TrainConfig
from dorarl.trainer import LossConfig, Trainer, TrainerConfig
from dorarl.trainer.advantages import group_advantages, overlong_penalty
from dorarl.trainer.batch import build_sequences


def _group(rewards: list[float], lengths: list[int], finish: list[str]) -> Group:
    samples = [
        Sample(0, i, 0, [1, 5], [7] * n, [-1.0] * n, [0] * n, finish_reason=f, reward=r)
        for i, (r, n, f) in enumerate(zip(rewards, lengths, finish, strict=True))
    ]
    return Group(0, 0, 0, samples)


def _episode(reward: float, turns: list[Turn]) -> Sample:
    """A multi-turn sample as the runtime builds it: each turn's sampled tokens, then its
    observation (logprob 0, marked observed)."""
    observed = [flag for t in turns for flag in [False] * t.sampled + [True] * t.observed]
    n = len(observed)
    logprobs = [0.0 if o else -1.0 for o in observed]
    last = turns[-1].finish_reason
    return Sample(
        0, 0, 0, [1, 5], [7] * n, logprobs, [0] * n, last, reward, observed=observed, turns=turns
    )


def _with_index(samples: list[Sample]) -> Group:
    for i, s in enumerate(samples):
        s.sample_index = i
    return Group(0, 0, 0, samples)


@pytest.mark.parametrize(
    ("length", "penalty"),
    [(0, 0.0), (80, 0.0), (81, -0.05), (90, -0.5), (99, -0.95), (100, -1.0), (130, -1.0)],
)
def test_penalty_is_zero_then_linear_over_the_buffer_then_minus_one(length, penalty):
    assert overlong_penalty(length, cap=100, buffer=20) == pytest.approx(penalty)


@pytest.mark.parametrize("buffer", [0, 100, 101])
def test_penalty_needs_a_buffer_inside_the_cap(buffer):
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(50, cap=100, buffer=buffer)


def test_soft_shapes_the_rewards_before_the_group_advantages():
    # Equal rewards: no signal without the penalty; with it, longer responses lose.
    group = _group([1.0, 1.0, 1.0], [10, 95, 100], ["stop", "stop", "length"])
    plain = build_sequences([group], LossConfig())
    assert [s.advantage for s in plain] == [0.0, 0.0, 0.0]
    soft = LossConfig(overlong="soft", overlong_buffer=20, response_cap=100)
    shaped = build_sequences([group], soft)
    want = group_advantages([1.0, 1.0 - 0.75, 1.0 - 1.0])
    assert [s.advantage for s in shaped] == pytest.approx(want)
    assert shaped[0].advantage > shaped[1].advantage > shaped[2].advantage
    assert [len(s.response_ids) for s in shaped] == [10, 95, 100]  # nothing masked


def test_soft_judges_each_turn_of_an_episode_against_the_per_turn_cap():
    # Three right turns of 30 tokens with two observations of 20: 130 response tokens, yet
    # no turn comes near the cap of 64 the engines applied to each, so no penalty.
    fine = [Turn(30, 20, "stop"), Turn(30, 20, "stop"), Turn(30, 0, "stop")]
    single = _group([1.0, 0.0], [30, 30], ["stop", "stop"]).samples
    soft = LossConfig(overlong="soft", overlong_buffer=16, response_cap=64)
    seqs = build_sequences([_with_index([_episode(1.0, fine), *single])], soft)
    assert [s.advantage for s in seqs] == pytest.approx(group_advantages([1.0, 1.0, 0.0]))


def test_soft_takes_the_worst_turns_penalty():
    # The middle turn is 8 tokens into the buffer of 16 (-0.5), the last 4 (-0.25).
    turns = [Turn(10, 5, "stop"), Turn(56, 5, "stop"), Turn(52, 0, "stop")]
    group = _with_index([_episode(1.0, turns), _group([0.0], [5], ["stop"]).samples[0]])
    soft = LossConfig(overlong="soft", overlong_buffer=16, response_cap=64)
    seqs = build_sequences([group], soft)
    assert [s.advantage for s in seqs] == pytest.approx(group_advantages([1.0 - 0.5, 0.0]))


def test_soft_without_the_cap_is_a_bug_upstream():
    with pytest.raises(ValueError, match="response cap"):
        build_sequences([_group([1.0, 0.0], [3, 4], ["stop"] * 2)], LossConfig(overlong="soft"))


def test_mask_drops_truncated_responses_but_keeps_their_rewards_in_the_group():
    group = _group([1.0, 0.0, 0.0], [5, 7, 9], ["stop", "stop", "length"])
    masked = build_sequences([group], LossConfig(overlong="mask"))
    kept = build_sequences([group], LossConfig())
    assert [len(s.response_ids) for s in masked] == [5, 7, 0]
    assert [s.advantage for s in masked] == [s.advantage for s in kept]
    assert masked[2].weight == 0.0 and masked[0].weight == pytest.approx(1 / 12)


def test_mask_drops_an_episode_whose_middle_turn_hit_the_cap():
    cut_middle = [Turn(10, 4, "stop"), Turn(64, 4, "length"), Turn(10, 0, "stop")]
    whole = [Turn(10, 4, "stop"), Turn(20, 0, "stop")]
    group = _with_index([_episode(1.0, cut_middle), _episode(0.0, whole)])
    masked = build_sequences([group], LossConfig(overlong="mask"))
    assert [len(s.response_ids) for s in masked] == [0, 34]
    assert masked[0].weight == 0.0 and masked[1].weight == pytest.approx(1 / 30)


def test_a_batch_of_only_truncated_responses_trains_nothing_under_mask(tiny_model_dir):
    groups = [_group([1.0, 0.0], [4, 6], ["length", "length"])]
    config = TrainerConfig(lr=1e-3, loss=LossConfig(overlong="mask"))
    metrics = Trainer.from_pretrained(tiny_model_dir, config).train_step(groups)
    assert metrics["tokens"] == 0 and metrics["update_applied"] == 0.0
    plain = Trainer.from_pretrained(tiny_model_dir, TrainerConfig(lr=1e-3))
    assert plain.train_step(groups)["update_applied"] == 1.0


def test_the_cap_is_the_engines_and_soft_needs_it():
    config = load_config(TrainConfig, overrides=["sampling.max_new_tokens=48"])
    assert config.trainer.loss.response_cap == 48
    with pytest.raises(ConfigError, match="^trainer.loss.overlong: soft needs sampling.max_new"):
        load_config(TrainConfig, overrides=["trainer.loss.overlong=soft"])
    with pytest.raises(ConfigError, match="^trainer.loss.overlong_buffer: 64 tokens must be fewer"):
        load_config(
            TrainConfig, overrides=["trainer.loss.overlong=soft", "sampling.max_new_tokens=64"]
        )
    with pytest.raises(ConfigError, match="^trainer.loss.response_cap: follows sampling.max_new"):
        load_config(TrainConfig, overrides=["trainer.loss.response_cap=10"])
    ok = [
        "trainer.loss.overlong=soft",
        "trainer.loss.overlong_buffer=16",
        "sampling.max_new_tokens=64",
    ]
    assert load_config(TrainConfig, overrides=ok).trainer.loss.response_cap == 64


def test_the_old_mask_truncated_key_reads_as_overlong_mask():
    # config.json of runs before the key was renamed hold it as the derived value
    assert load_config(TrainConfig, overrides=["trainer.loss.mask_truncated=false"]) == load_config(
        TrainConfig
    )
    masked = load_config(TrainConfig, overrides=["trainer.loss.overlong=mask"])
    assert masked.trainer.loss.mask_truncated
    with pytest.raises(
        ConfigError, match="^trainer.loss.mask_truncated: follows trainer.loss.overlong"
    ):
        load_config(TrainConfig, overrides=["trainer.loss.mask_truncated=true"])
