"""The engine/trainer log-prob mismatch figures of a step against a float64 reference on
hand-made batches (several micro-batches, both packings, stale and observed tokens left out
where they must be), and on the trainer's own forward."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from dorarl.data import Group, Sample, SegmentStart, Turn
from dorarl.trainer import Trainer, TrainerConfig
from dorarl.trainer.batch import build_sequences
from dorarl.trainer.config import LossConfig
from dorarl.trainer.mismatch import percentile
from dorarl.trainer.packing import micro_batches
from dorarl.trainer.totals import StepTotals

TRAINED = 3  # the version the trainer holds


def _sample(rng, g: int, i: int, prompt: list[int], ids: list[int], versions, observed=()):
    observed = list(observed) or [False] * len(ids)
    logprobs = [0.0 if o else -rng.uniform(0.1, 4.0) for o in observed]
    return Sample(
        group_id=g, sample_index=i, prompt_id=g, prompt_ids=prompt, response_ids=ids,
        logprobs=logprobs, versions=list(versions), finish_reason="stop", reward=float(i % 2),
        observed=observed if any(observed) else [],
        turns=[Turn(len(ids), 0, "stop")] if any(observed) else [],
    )  # fmt: skip


def _groups() -> list[Group]:
    """Every token id unique (theta[id] is its trainer log-prob). Group 0: fresh samples, one
    with a stale first token (a partial rollout finished by the trained version); group 1:
    stale samples; group 2: an episode of two segments with observed tokens."""
    rng = random.Random(7)
    ids = iter(range(1, 1000))

    def take(n):
        return [next(ids) for _ in range(n)]

    p0, p1, p2 = take(3), take(4), take(2)
    fresh = [_sample(rng, 0, i, p0, take(n), [TRAINED] * n) for i, n in enumerate((5, 1, 7))]
    mixed = _sample(rng, 0, 3, p0, take(4), [TRAINED - 1] + [TRAINED] * 3)
    stale = [_sample(rng, 1, i, p1, take(n), [TRAINED - 2] * n) for i, n in enumerate((6, 2))]
    episode = _sample(rng, 2, 0, p2, take(9), [TRAINED] * 9, [False] * 3 + [True] * 2 + [False] * 4)
    episode.segments = [SegmentStart(3, 2)]
    episode.observed[6] = True  # an observation inside the second segment's reply, too
    episode.logprobs[6] = 0.0
    return [
        Group(group_id=0, prompt_id=0, version=TRAINED, samples=[*fresh, mixed]),
        Group(group_id=1, prompt_id=1, version=TRAINED - 2, samples=stale),
        Group(group_id=2, prompt_id=2, version=TRAINED, samples=[episode]),
    ]


def _theta(groups: list[Group]) -> torch.Tensor:
    """Per token id, a trainer log-prob near the behavior one."""
    gen = torch.Generator().manual_seed(3)
    theta = torch.zeros(1000, dtype=torch.float64)
    for s in (s for g in groups for s in g.samples):
        drift = torch.randn(len(s.response_ids), generator=gen, dtype=torch.float64) * 0.3
        theta[s.response_ids] = torch.tensor(s.logprobs, dtype=torch.float64) + drift
    return theta


def _reference(groups: list[Group], theta: torch.Tensor) -> dict[str, float]:
    """From the samples alone: every trained token's log-ratio, and the fresh ones'."""
    every, fresh = [], []
    for s in (s for g in groups for s in g.samples):
        observed = s.observed or [False] * len(s.response_ids)
        for tid, b, v, o in zip(s.response_ids, s.logprobs, s.versions, observed, strict=True):
            if not o:
                every.append(float(theta[tid]) - b)
                if v == TRAINED:
                    fresh.append(float(theta[tid]) - b)
    out = {"rollout_fresh_tokens": float(len(fresh))}
    for suffix, values in (("", np.array(every)), ("_fresh", np.array(fresh))):
        out[f"rollout_logp_abs_diff{suffix}"] = float(np.abs(values).mean())
        out[f"rollout_ratio_p1{suffix}"] = float(np.percentile(np.exp(values), 1))
        out[f"rollout_ratio_p99{suffix}"] = float(np.percentile(np.exp(values), 99))
    return out


@pytest.mark.parametrize("packing", ["padded", "shared_prompt"])
def test_figures_equal_a_float64_reference_over_micro_batches(packing):
    groups = _groups()
    theta = _theta(groups)
    seqs = build_sequences(groups, LossConfig())
    totals = StepTotals()
    batches = micro_batches(seqs, 16, packing, 0, "cpu", dtype=torch.float64)
    assert len(batches) >= 3
    for mb in batches:
        totals.add_mismatch(mb, theta[mb.targets], TRAINED)
    got = totals.mismatch.summary()
    want = _reference(groups, theta)
    assert want["rollout_fresh_tokens"] == 5 + 1 + 7 + 3 + 3 + 3  # stale and observed out
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
    assert got["rollout_logp_abs_diff"] != got["rollout_logp_abs_diff_fresh"]


def test_a_step_without_fresh_tokens_has_no_fresh_figures():
    groups = _groups()
    theta = _theta(groups)
    totals = StepTotals()
    for mb in micro_batches(build_sequences(groups, LossConfig()), 16, "padded", 0, "cpu"):
        totals.add_mismatch(mb, theta[mb.targets].float(), TRAINED + 1)
    got = totals.summary()
    assert got["rollout_fresh_tokens"] == 0.0
    assert "rollout_ratio_p1" in got and "rollout_ratio_p1_fresh" not in got


@pytest.mark.parametrize("q", [0, 1, 37.5, 99, 100])
def test_percentile_is_numpys_linear_one(q):
    values = np.random.default_rng(1).lognormal(size=101 + int(q))
    ordered = torch.sort(torch.tensor(values)).values
    assert percentile(ordered, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-14)


def test_the_trainers_forward_on_its_own_samples_has_ratio_one(tiny_model_dir, make_groups):
    """Behavior log-probs from the trained model itself: fresh tokens have ratio 1 (up to
    float32); a stale group's tokens, with other log-probs, count only in the all-token figures."""
    trainer = Trainer.from_pretrained(tiny_model_dir, TrainerConfig(micro_batch_tokens=40))
    trainer.version = TRAINED  # as a resumed trainer's
    groups = make_groups(seed=5, version=TRAINED)
    for s in groups[0].samples:
        s.logprobs = _model_logprobs(trainer, s)
    for s in groups[1].samples:
        s.logprobs = [lp - 0.5 for lp in _model_logprobs(trainer, s)]
        s.versions = [TRAINED - 1] * len(s.response_ids)
    groups = groups[:2]
    metrics = trainer.train_step(groups)
    assert metrics["micro_batches"] >= 2
    fresh, stale = (sum(len(s.response_ids) for s in g.samples) for g in groups)
    assert metrics["rollout_fresh_tokens"] == fresh
    assert metrics["rollout_logp_abs_diff_fresh"] < 1e-5
    assert 1 - 1e-5 < metrics["rollout_ratio_p1_fresh"] <= metrics["rollout_ratio_p99_fresh"]
    assert metrics["rollout_ratio_p99_fresh"] < 1 + 1e-5
    assert metrics["rollout_ratio_p99"] == pytest.approx(np.exp(0.5), rel=1e-4)
    want = 0.5 * stale / (fresh + stale)
    assert metrics["rollout_logp_abs_diff"] == pytest.approx(want, rel=1e-4)


def _model_logprobs(trainer: Trainer, s: Sample) -> list[float]:
    from dorarl.trainer.loss import token_logprobs

    ids = torch.tensor([s.prompt_ids + s.response_ids])
    with torch.no_grad():
        logits = trainer.model(input_ids=ids).logits[:, :-1]
    return token_logprobs(logits, ids[:, 1:])[0, len(s.prompt_ids) - 1 :].tolist()
