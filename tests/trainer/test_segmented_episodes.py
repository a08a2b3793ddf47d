"""Episodes of several segments: each segment trains in a context of its own, as the same
tokens trained as separate samples with the episode's advantage would, packed or padded,
in one micro-batch or many."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from test_packing import _assert_same_step, _groups, _step, _trainer

from dorarl.data import Group, Sample, SegmentStart, Turn
from dorarl.trainer import LossConfig, TrainerConfig
from dorarl.trainer.batch import build_sequences


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 101) for _ in range(n)]


def _sampled(rng: random.Random, n: int) -> list[float]:
    return [-rng.uniform(0.5, 6.0) for _ in range(n)]


def _part(rng: random.Random, sampled: int, observed: int, then: int):
    """A segment's response: sampled tokens, an observation (a tool's delta), sampled again."""
    ids = _ids(rng, sampled + observed + then)
    logprobs = _sampled(rng, sampled) + [0.0] * observed + _sampled(rng, then)
    mask = [False] * sampled + [True] * observed + [False] * then
    return ids, logprobs, mask


def _episode(index: int, prompt, parts, reward: float) -> Sample:
    """One sample of several segments: `parts` is [(prompt, (ids, logprobs, observed))], the
    first segment's prompt being `prompt`."""
    ids, logprobs, observed, segments = [], [], [], []
    for k, (segment_prompt, (r_ids, r_lp, r_obs)) in enumerate(parts):
        if k:
            segments.append(SegmentStart(len(ids), len(segment_prompt)))
            ids, logprobs = ids + segment_prompt, logprobs + [0.0] * len(segment_prompt)
            observed = observed + [True] * len(segment_prompt)
        ids, logprobs, observed = ids + r_ids, logprobs + r_lp, observed + r_obs
    return Sample(
        group_id=0, sample_index=index, prompt_id=0, prompt_ids=prompt, response_ids=ids,
        logprobs=logprobs, versions=[0] * len(ids), finish_reason="stop", reward=reward,
        observed=observed, turns=[Turn(1, 0, "stop")], segments=segments,
    )  # fmt: skip


def _alone(index: int, prompt, part, reward: float) -> Sample:
    ids, logprobs, observed = part
    return Sample(
        group_id=0, sample_index=index, prompt_id=0, prompt_ids=prompt, response_ids=ids,
        logprobs=logprobs, versions=[0] * len(ids), finish_reason="stop", reward=reward,
        observed=observed, turns=[Turn(1, 0, "stop")],
    )  # fmt: skip


def _batches(seed: int):
    """The same tokens twice: a group with a two-segment episode (reward 1) and a one-segment
    one (reward 0), and a group where the two segments are two samples (reward 1 each) beside
    the same one-segment sample and an empty one (reward 0). With advantages r - mean, every
    sample of both groups has the advantage its counterpart has. Other groups ride along."""
    rng = random.Random(seed)
    prompt, second_prompt = [1, *_ids(rng, 7)], [2, *_ids(rng, 11)]
    one, two, other = _part(rng, 6, 3, 4), _part(rng, 5, 2, 3), _part(rng, 9, 0, 0)
    segmented = Group(0, 0, 0, [
        _episode(0, prompt, [(prompt, one), (second_prompt, two)], 1.0),
        _alone(1, prompt, other, 0.0),
    ])  # fmt: skip
    separate = Group(0, 0, 0, [
        _alone(0, prompt, one, 1.0),
        _alone(1, second_prompt, two, 1.0),
        _alone(2, prompt, other, 0.0),
        _alone(3, prompt, ([], [], []), 0.0),
    ])  # fmt: skip
    riders = _groups(seed=seed, n_groups=2, sizes=(2, 4), lengths=(1, 10))
    for g, group in enumerate(riders, 1):
        group.group_id = g
    return [segmented, *riders], [separate, *copy.deepcopy(riders)]


@pytest.mark.parametrize("packing", ["shared_prompt", "padded"])
@pytest.mark.parametrize("budget", [10**6, 24])
def test_a_two_segment_episode_trains_as_its_segments_as_separate_samples(
    tmp_path, single_thread, packing, budget
):
    loss = LossConfig(normalize_std=False, kl_coef=0.05, entropy_coef=0.01)
    trainer = _trainer("qwen2", tmp_path, TrainerConfig(loss=loss, micro_batch_tokens=budget))
    segmented, separate = _batches(seed=3)
    got, grads = _step(trainer, segmented, packing)
    want, want_grads = _step(trainer, separate, packing)
    sampled = sum(s.observed.count(False) if s.observed else len(s.response_ids) for g in segmented for s in g.samples)  # fmt: skip
    assert got["tokens"] == want["tokens"] == sampled
    for key, value in want.items():
        if key != "micro_batches":
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7)


def test_segments_get_the_episodes_advantage_and_token_mean_weights():
    segmented, separate = _batches(seed=4)
    cfg = LossConfig(normalize_std=False)
    got = build_sequences(segmented, cfg)
    want = build_sequences(separate, cfg)
    by_tokens = {tuple(s.response_ids): s for s in want}
    assert len(got) == len(want) - 1  # the empty sample adds no sequence of tokens
    for seq in got:
        twin = by_tokens[tuple(seq.response_ids)]
        assert (seq.prompt_ids, seq.behavior_logprobs, seq.loss_mask) == (twin.prompt_ids, twin.behavior_logprobs, twin.loss_mask)  # fmt: skip
        assert (seq.advantage, seq.weight) == (twin.advantage, twin.weight)
    assert got[0].advantage == got[1].advantage == 0.5


def test_with_seq_mean_an_episode_weighs_as_one_sequence():
    segmented, _ = _batches(seed=5)
    seqs = build_sequences(segmented, LossConfig(aggregation="seq_mean"))
    samples = sum(1 for g in segmented for s in g.samples)
    first, second = seqs[0], seqs[1]
    tokens = first.trained_tokens + second.trained_tokens
    assert first.weight == second.weight == pytest.approx(1.0 / (tokens * samples))
    total = sum(w for s in seqs for w in s.token_weights())
    assert total == pytest.approx(1.0)


def test_a_segment_prompt_that_is_not_observed_is_refused():
    segmented, _ = _batches(seed=6)
    episode = segmented[0].samples[0]
    episode.observed[episode.segments[0].at] = False
    with pytest.raises(ValueError, match="is not observed tokens"):
        build_sequences(segmented, LossConfig())
    episode.segments = [SegmentStart(len(episode.response_ids), 3)]
    with pytest.raises(ValueError, match="does not fit its response"):
        build_sequences(segmented, LossConfig())


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_packed_equals_padded_with_segmented_episodes(tmp_path, single_thread, aggregation):
    config = TrainerConfig(loss=LossConfig(aggregation=aggregation), micro_batch_tokens=40)
    trainer = _trainer("llama", tmp_path, config)
    segmented, _ = _batches(seed=7)
    _assert_same_step(trainer, segmented)
