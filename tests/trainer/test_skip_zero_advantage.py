"""trainer.skip_zero_advantage: sequences whose advantage is 0 are left out of the forward and
backward, and the gradient, the loss and every update stay those of the whole batch."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import _make_groups  # noqa: E402
from ranks import run_ranks  # noqa: E402

from dorarl.trainer import LossConfig, Trainer, TrainerConfig  # noqa: E402
from dorarl.trainer.sharded import ShardedTrainer  # noqa: E402


def _equal_rewards(groups: list, which: list[int], reward: float = 1.0) -> list:
    for index in which:
        for sample in groups[index].samples:
            sample.reward = reward
    return groups


def _mixed_batch(seed: int) -> list:
    """Five groups: two with equal rewards (one all right, one all wrong), three mixed."""
    groups = _make_groups(seed=seed, n_groups=5)
    _equal_rewards(groups, [1], 1.0)
    _equal_rewards(groups, [3], 0.0)
    for group in groups[::2]:  # the others hold a right and a wrong answer
        group.samples[0].reward, group.samples[1].reward = 1.0, 0.0
    return groups


def _tokens(groups: list, which: list[int]) -> int:
    return sum(len(s.response_ids) for i in which for s in groups[i].samples)


def _trainer(folder, skip: bool, **keys) -> Trainer:
    loss = keys.pop("loss", LossConfig())
    config = TrainerConfig(lr=1e-3, adam_eps=1e-6, skip_zero_advantage=skip, loss=loss, **keys)
    return Trainer.from_pretrained(folder, config)


def _assert_close(got: dict, want: dict, rel: float = 1e-5) -> None:
    """Each tensor within `rel` of the other, relative to its norm: the sums run in another
    order when fewer sequences are computed, and AdamW magnifies that rounding element-wise."""
    assert got.keys() == want.keys()
    for name, value in want.items():
        error = float((got[name] - value).norm() / value.norm())
        assert error <= rel, f"{name}: relative error {error:.2e}"


def _grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("packing", ["shared_prompt", "padded"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean", "seq_sum_norm"])
def test_skipping_zero_advantage_sequences_keeps_the_gradient(tiny_model_dir, packing, aggregation):
    groups = _mixed_batch(seed=21)
    norm = {"norm_length": 16} if aggregation == "seq_sum_norm" else {}
    loss = LossConfig(aggregation=aggregation, **norm)
    runs = {}
    for skip in (False, True):
        trainer = _trainer(tiny_model_dir, skip, loss=loss, packing=packing, micro_batch_tokens=48)
        runs[skip] = (trainer.accumulate_gradients(groups), _grads(trainer))
    (whole, whole_grads), (skipped, skipped_grads) = runs[False], runs[True]
    assert whole["zero_advantage_tokens"] == 0
    assert skipped["zero_advantage_tokens"] == _tokens(groups, [1, 3]) > 0
    assert skipped["tokens"] == whole["tokens"]  # the loss's tokens, computed or not
    assert skipped["micro_batches"] < whole["micro_batches"]  # less computed
    assert skipped["loss"] == pytest.approx(whole["loss"], rel=1e-5, abs=1e-8)
    assert skipped_grads.keys() == whole_grads.keys() and whole_grads
    for name, grad in whole_grads.items():
        assert torch.allclose(skipped_grads[name], grad, rtol=1e-4, atol=1e-8), name


def test_an_all_zero_advantage_step_updates_as_its_zero_gradient_does(tiny_model_dir):
    """AdamW's moments move the weights on a zero gradient: skipping every sequence must
    step the same way, not skip the update."""
    zero = _equal_rewards(_make_groups(seed=23), [0, 1, 2])
    after = {}
    for skip in (False, True):
        trainer = _trainer(tiny_model_dir, skip)
        trainer.train_step(_mixed_batch(seed=22))
        first = trainer.named_tensors()
        metrics = trainer.train_step(zero)
        after[skip] = (trainer.named_tensors(), metrics)
    (whole, whole_metrics), (skipped, metrics) = after[False], after[True]
    assert metrics["tokens"] == metrics["zero_advantage_tokens"] > 0
    assert metrics["update_applied"] == whole_metrics["update_applied"] == 1.0
    assert metrics["grad_norm"] == whole_metrics["grad_norm"] == 0.0
    _assert_close(skipped, whole)
    assert any(not torch.equal(first[k], skipped[k]) for k in first)  # the moments moved them


@pytest.mark.parametrize("keys", [{"kl_coef": 0.05}, {"entropy_coef": 0.01}])
def test_a_term_that_reads_every_token_keeps_zero_advantage_sequences(tiny_model_dir, keys):
    groups = _mixed_batch(seed=24)
    trainer = _trainer(tiny_model_dir, True, loss=LossConfig(**keys))
    metrics = trainer.accumulate_gradients(groups)
    assert metrics["zero_advantage_tokens"] == 0
    assert metrics["tokens"] == _tokens(groups, [0, 1, 2, 3, 4])


def test_a_batch_baseline_gives_equal_reward_groups_an_advantage(tiny_model_dir):
    """REINFORCE++ normalises over the step's samples: a group of equal rewards still has a
    non-zero advantage, and is trained."""
    groups = _mixed_batch(seed=25)
    trainer = _trainer(tiny_model_dir, True, loss=LossConfig(advantage="reinforce_pp"))
    metrics = trainer.accumulate_gradients(groups)
    assert metrics["zero_advantage_tokens"] == 0


def _sharded_steps(group, folder, batches):
    config = TrainerConfig(lr=1e-3, adam_eps=1e-6, micro_batch_tokens=22)
    trainer = ShardedTrainer.from_pretrained_group(folder, config, group)
    metrics = [trainer.train_step(groups) for groups in batches]
    steps = [(m["loss"], m["grad_norm"], m["tokens"], m["zero_advantage_tokens"]) for m in metrics]
    return steps, trainer.named_tensors()


def test_world_size_two_skips_as_one_process(tiny_model_dir):
    """Ranks share only the sequences computed; a step where every sequence is skipped still
    updates on every rank."""
    batches = [_mixed_batch(22), _equal_rewards(_make_groups(seed=23), [0, 1, 2]), _mixed_batch(26)]
    got, weights = run_ranks(_sharded_steps, 2, tiny_model_dir, batches)
    single = Trainer.from_pretrained(
        tiny_model_dir, TrainerConfig(lr=1e-3, adam_eps=1e-6, micro_batch_tokens=22)
    )
    want = [single.train_step(groups) for groups in batches]
    assert got[1][2] == got[1][3] > 0  # nothing computed at step 2
    for (loss, norm, tokens, skipped), metrics in zip(got, want, strict=True):
        assert (tokens, skipped) == (metrics["tokens"], metrics["zero_advantage_tokens"])
        assert loss == pytest.approx(metrics["loss"], rel=1e-5, abs=1e-8)
        assert norm == pytest.approx(metrics["grad_norm"], rel=1e-5, abs=1e-8)
    _assert_close(weights, single.named_tensors())
