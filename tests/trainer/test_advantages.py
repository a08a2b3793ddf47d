"""Advantages (GRPO, RLOO, REINFORCE++): hand values, zero-sum, equal rewards give zero."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dorarl.trainer.advantages import group_advantages, rloo_advantages, step_advantages


def test_hand_computed_advantages():
    # mean 0.25, unbiased std 0.5
    assert group_advantages([1.0, 0.0, 0.0, 0.0], eps=0.0) == pytest.approx([1.5, -0.5, -0.5, -0.5])
    assert group_advantages([1.0, 0.0, 0.0, 0.0], normalize_std=False) == pytest.approx(
        [0.75, -0.25, -0.25, -0.25]
    )


def test_equal_rewards_and_singletons_have_zero_advantage():
    assert group_advantages([0.7] * 5) == [0.0] * 5
    assert group_advantages([1.0]) == [0.0]
    assert group_advantages([]) == []


@pytest.mark.parametrize("normalize", [True, False])
def test_equal_rewards_give_exact_zeros_even_when_the_mean_rounds(normalize):
    # sum([0.7] * 3) / 3 is 0.7 + 1 ulp: centred rewards are not exactly 0, and with eps=0
    # dividing them by their own (tiny) std used to give 0.8165 each.
    assert sum([0.7] * 3) / 3 != 0.7
    assert group_advantages([0.7] * 3, normalize, 0.0) == [0.0] * 3


@given(
    st.floats(-1e6, 1e6, allow_nan=False),
    st.integers(2, 64),
    st.floats(0.0, 1.0),
    st.booleans(),
)
def test_all_equal_groups_have_zero_advantage_whatever_eps(reward, size, eps, normalize):
    assert group_advantages([reward] * size, normalize, eps) == [0.0] * size


def test_negative_eps_is_refused():
    with pytest.raises(ValueError, match="eps"):
        group_advantages([1.0, 0.0], True, -1e-6)


@given(st.lists(st.floats(-10, 10, allow_nan=False), min_size=2, max_size=16), st.booleans())
def test_advantages_sum_to_zero_and_keep_the_order(rewards, normalize):
    adv = group_advantages(rewards, normalize_std=normalize)
    assert sum(adv) == pytest.approx(0.0, abs=1e-6)
    for i in range(len(rewards)):
        for j in range(len(rewards)):
            if rewards[i] > rewards[j]:
                assert adv[i] >= adv[j]


def test_rloo_subtracts_the_mean_of_the_other_rewards():
    assert rloo_advantages([1.0, 0.0, 0.0, 1.0]) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert rloo_advantages([0.5]) == [0.0]  # no other sample: no baseline, no signal
    assert rloo_advantages([0.3, 0.3, 0.3]) == [0.0, 0.0, 0.0]


def test_reinforce_pp_normalises_over_the_whole_batch_not_the_group():
    rewards = [[1.0, 1.0], [0.0, 0.0]]  # each group all equal: GRPO and RLOO give 0
    assert step_advantages(rewards, "grpo") == [[0.0, 0.0], [0.0, 0.0]]
    assert step_advantages(rewards, "rloo") == [[0.0, 0.0], [0.0, 0.0]]
    std = math.sqrt(4 * 0.25 / 3)
    got = step_advantages(rewards, "reinforce_pp", True, 0.0)
    assert got[0] + got[1] == pytest.approx([0.5 / std] * 2 + [-0.5 / std] * 2)
    assert step_advantages([[1.0], [1.0]], "reinforce_pp") == [[0.0], [0.0]]
