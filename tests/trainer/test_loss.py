"""The GRPO loss against hand-computed values, and its gradient against the plain policy gradient."""

import math

import pytest
import torch

from dorarl.trainer.config import LossConfig
from dorarl.trainer.loss import (
    k3_kl,
    objective,
    policy_terms,
    token_entropy,
    token_logprobs,
    token_weights,
)

E = math.exp(0.5)  # ratio when logp - behavior = +0.5


def _five_tokens():
    # ratios: e^.5, e^-.5, e^-.5, e^.5, 1 ; advantages: +1, +1, -1, -1, +2
    logp = torch.tensor([0.0, -1.0, -1.0, 0.0, -0.3])
    behavior = torch.tensor([-0.5, -0.5, -0.5, -0.5, -0.3])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 2.0])
    return logp, behavior, adv


def test_clipped_loss_matches_hand_values_on_both_sides():
    logp, behavior, adv = _five_tokens()
    terms = policy_terms(logp, behavior, adv, LossConfig(eps_low=0.2, eps_high=0.28))
    expected = [
        -1.28,  # A>0, ratio 1.65 above 1.28: clipped at 1 + eps_high
        -1 / E,  # A>0, ratio 0.61 below 0.8: not clipped (min picks ratio * A)
        0.8,  # A<0, ratio 0.61 below 0.8: clipped at 1 - eps_low
        E,  # A<0, ratio 1.65: not clipped, the loss grows with the ratio
        -2.0,  # ratio 1
    ]
    assert terms.loss.tolist() == pytest.approx(expected, abs=1e-6)
    assert terms.clipped_high.tolist() == [True, False, False, False, False]
    assert terms.clipped_low.tolist() == [False, False, True, False, False]


def test_dual_clip_bounds_negative_advantage_loss():
    logp, behavior, adv = _five_tokens()
    terms = policy_terms(logp, behavior, adv, LossConfig(dual_clip=1.5))
    assert terms.loss[3].item() == pytest.approx(1.5)
    assert terms.loss[0].item() == pytest.approx(-1.28)


def test_token_mean_and_sequence_mean_aggregation():
    # Two responses: 1 token with loss 4, 3 tokens with losses 1, 2, 3.
    per_token = torch.tensor([4.0, 1.0, 2.0, 3.0])
    tok = token_weights([1, 3], "token_mean", total_tokens=4, total_sequences=2)
    seq = token_weights([1, 3], "seq_mean", total_tokens=4, total_sequences=2)
    w_tok = torch.tensor([tok[0], tok[1], tok[1], tok[1]])
    w_seq = torch.tensor([seq[0], seq[1], seq[1], seq[1]])
    assert (per_token * w_tok).sum().item() == pytest.approx(10 / 4)
    assert (per_token * w_seq).sum().item() == pytest.approx((4 / 1 + 6 / 3) / 2)


def test_ratio_one_gives_the_plain_policy_gradient():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5))
    adv = torch.tensor([[1.5] * 5, [-0.7] * 5])
    weights = torch.rand(2, 5)
    logp = token_logprobs(logits, targets)
    loss, terms = objective(logp, logp.detach(), adv, weights, LossConfig())
    (grad,) = torch.autograd.grad(loss, logits)
    plain = -(adv * token_logprobs(logits, targets) * weights).sum()
    (expected,) = torch.autograd.grad(plain, logits)
    assert torch.allclose(terms.ratio, torch.ones_like(terms.ratio))
    assert torch.allclose(grad, expected, atol=1e-6)


def test_clipped_tokens_get_no_gradient():
    logp = torch.tensor([0.0, -1.0], requires_grad=True)
    behavior = torch.tensor([-0.5, -0.5])
    adv = torch.tensor([1.0, -1.0])  # token 0 clipped high, token 1 clipped low
    loss, _ = objective(logp, behavior, adv, torch.ones(2), LossConfig())
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad.tolist() == [0.0, 0.0]


def test_proximal_mode_weights_by_truncated_importance():
    logp = torch.tensor([-0.1, -2.0], requires_grad=True)
    behavior = torch.tensor([-1.0, -1.9])  # weights e^0.9 = 2.46 (capped to 2) and e^-0.1
    adv = torch.tensor([1.0, -1.0])
    cfg = LossConfig(ratio_base="proximal", tis_cap=2.0)
    loss, terms = objective(logp, behavior, adv, torch.ones(2), cfg)
    w1 = math.exp(-0.1)
    assert terms.importance.tolist() == pytest.approx([2.0, w1])
    assert terms.truncated.tolist() == [True, False]
    assert loss.item() == pytest.approx(-2.0 + w1)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad.tolist() == pytest.approx([-2.0, w1])


def test_k3_kl_is_zero_on_equal_policies_and_matches_hand_value():
    logp = torch.tensor([-1.0, -1.0])
    ref = torch.tensor([-1.0, -1.0 + math.log(2.0)])
    assert k3_kl(logp, ref).tolist() == pytest.approx([0.0, 2.0 - math.log(2.0) - 1.0])
    assert (k3_kl(torch.randn(100), torch.randn(100)) >= 0).all()


def test_kl_term_enters_the_loss_with_its_coefficient():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    adv = torch.zeros(2)
    loss, _ = objective(logp, logp, adv, torch.full((2,), 0.5), LossConfig(kl_coef=0.1), ref)
    assert loss.item() == pytest.approx(0.1 * 0.5 * k3_kl(logp, ref).sum().item())


def test_logprobs_and_entropy_use_the_sampling_temperature():
    torch.manual_seed(1)
    logits = torch.randn(3, 7)
    targets = torch.tensor([0, 3, 6])
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, targets[:, None]).squeeze(-1)
    assert torch.allclose(token_logprobs(logits, targets, 0.7), expected)
    uniform = token_entropy(torch.zeros(1, 8))
    assert uniform.item() == pytest.approx(math.log(8))
