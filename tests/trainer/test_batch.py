"""Micro-batch planning and collation: every token once, inside the budget, aligned to logits."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from dorarl.data import Group, Sample
from dorarl.trainer.batch import build_sequences, collate, plan_micro_batches
from dorarl.trainer.config import LossConfig


@given(st.lists(st.integers(1, 300), min_size=1, max_size=60), st.integers(1, 2000))
def test_plan_covers_every_row_once_within_the_budget(lengths, budget):
    plan = plan_micro_batches(lengths, budget)
    flat = [i for batch in plan for i in batch]
    assert sorted(flat) == list(range(len(lengths)))
    for batch in plan:
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= budget


def _group(rewards, responses, finish=None):
    samples = [
        Sample(
            group_id=0,
            sample_index=i,
            prompt_id=0,
            prompt_ids=[1, 5, 6],
            response_ids=r,
            logprobs=[-0.5 - j for j in range(len(r))],
            versions=[0] * len(r),
            finish_reason=(finish or ["stop"] * len(rewards))[i],
            reward=rw,
        )
        for i, (rw, r) in enumerate(zip(rewards, responses, strict=True))
    ]
    return Group(group_id=0, prompt_id=0, version=0, samples=samples)


def test_collate_aligns_response_tokens_with_the_logits_that_predict_them():
    seqs = build_sequences([_group([1.0, 0.0], [[7, 8], [9]])], LossConfig(normalize_std=False))
    mb = collate(seqs, pad_id=0, device="cpu")
    assert mb.input_ids.tolist() == [[1, 5, 6, 7, 8], [1, 5, 6, 9, 0]]
    # Position t of the shifted tensors predicts input token t + 1.
    assert mb.mask.tolist() == [[False, False, True, True], [False, False, True, False]]
    assert mb.targets[mb.mask].tolist() == [7, 8, 9]
    assert mb.behavior_logp[mb.mask].tolist() == [-0.5, -1.5, -0.5]
    assert mb.advantages[mb.mask].tolist() == [0.5, 0.5, -0.5]
    assert torch.allclose(mb.weights[mb.mask], torch.full((3,), 1 / 3))


def test_sequence_mean_weights_and_masked_truncations():
    group = _group([1.0, 0.0, 0.0], [[7, 8, 9, 10], [9], [4, 4]], ["stop", "stop", "length"])
    seqs = build_sequences([group], LossConfig(aggregation="seq_mean", overlong="mask"))
    assert [len(s.response_ids) for s in seqs] == [4, 1, 0]
    assert [s.weight for s in seqs] == [1 / (4 * 2), 1 / (1 * 2), 0.0]
