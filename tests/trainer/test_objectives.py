"""Every objective against an independent float64 reference written from its paper's formula
(GRPO/PPO clip, GSPO and GSPO-token, CISPO, Dr. GRPO's constant normaliser, RLOO,
REINFORCE++, IcePop's mismatch mask): loss and gradient within 1e-10, on random batches of
mixed lengths, multi-segment episodes with observations and mixed behavior versions, packed
and padded, in several micro-batches."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch

from dorarl.data import Group, Sample, SegmentStart, Turn
from dorarl.trainer.batch import build_sequences
from dorarl.trainer.config import LossConfig
from dorarl.trainer.loss import Spans, objective
from dorarl.trainer.packing import micro_batches
from dorarl.trainer.totals import StepTotals

TOL = 1e-10


def _f32(x: float) -> float:
    """A float the trainer's float32 behavior tensors hold exactly."""
    return float(torch.tensor(x, dtype=torch.float32))


@dataclass
class Episode:
    """A sample and, per token id of its response, whether it is trained."""

    sample: Sample
    segments: list[list[int]]  # per segment, the positions of its response tokens


class Batch:
    """Random groups whose every token id is unique, so theta[id] is that token's logp."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.next_id = 1
        self.behavior: dict[int, float] = {}
        self.episodes: list[list[Episode]] = []
        rewards = [[1.0, 0.0, 0.5, 1.0], [1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0, 1.0], [0.5]]
        for g, group_rewards in enumerate(rewards):
            prompt = self._ids(self.rng.randint(2, 5))
            self.episodes.append(
                [self._episode(g, i, prompt, r) for i, r in enumerate(group_rewards)]
            )
        self.groups = [
            Group(group_id=g, prompt_id=g, version=3, samples=[e.sample for e in eps])
            for g, eps in enumerate(self.episodes)
        ]
        self.theta = torch.zeros(self.next_id, dtype=torch.float64)
        for tid, b in self.behavior.items():  # the policy drifted from the behavior
            self.theta[tid] = b + self.rng.gauss(0.0, 0.45)
        self.theta.requires_grad_(True)

    def _ids(self, n: int) -> list[int]:
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids

    def _episode(self, g: int, index: int, prompt: list[int], reward: float) -> Episode:
        ids, observed, segments, positions = [], [], [], []
        one_token = index == 0 and g == 0
        for k in range(1 if one_token else self.rng.randint(1, 3)):
            if k:
                segments.append(SegmentStart(len(ids), 2))
                ids, observed = ids + self._ids(2), observed + [True, True]
            start = len(ids)
            n = 1 if one_token else self.rng.randint(1, 7)
            ids += self._ids(n)
            observed += [
                not one_token and 0 < j < n - 1 and self.rng.random() < 0.3 for j in range(n)
            ]
            positions.append([p for p in range(start, len(ids)) if not observed[p]])
        logprobs = [0.0 if o else _f32(-self.rng.uniform(0.1, 4.0)) for o in observed]
        for tid, lp, o in zip(ids, logprobs, observed, strict=True):
            if not o:
                self.behavior[tid] = lp
        versions = [self.rng.choice([1, 2, 3]) for _ in ids]
        sample = Sample(
            group_id=g, sample_index=index, prompt_id=g, prompt_ids=prompt, response_ids=ids,
            logprobs=logprobs, versions=versions, finish_reason="stop", reward=reward,
            observed=observed, turns=[Turn(len(ids), 0, "stop")], segments=segments,
        )  # fmt: skip
        return Episode(sample, positions)


# ---- the reference, from the papers -------------------------------------------------------


def ref_advantages(rewards: list[list[float]], cfg: LossConfig) -> list[list[float]]:
    def grpo(r):  # Shao et al. 2024 (DeepSeekMath), Dr. GRPO without the std (Liu et al. 2025)
        n, mean = len(r), sum(r) / len(r)
        if n == 1:
            return [0.0]
        if not cfg.normalize_std:
            return [x - mean for x in r]
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / (n - 1))
        return [(x - mean) / (std + cfg.adv_eps) for x in r]

    def rloo(r):  # Ahmadian et al. 2024: r_i - mean of the others
        n = len(r)
        return [0.0] * n if n == 1 else [x - (sum(r) - x) / (n - 1) for x in r]

    if cfg.advantage == "grpo":
        return [grpo(r) for r in rewards]
    if cfg.advantage == "rloo":
        return [rloo(r) for r in rewards]
    flat = [x for r in rewards for x in r]  # REINFORCE++ (Hu 2025): global batch normalisation
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / (len(flat) - 1))
    it = iter([(x - mean) / (std + cfg.adv_eps) for x in flat])
    return [[next(it) for _ in r] for r in rewards]


def ref_loss(batch: Batch, cfg: LossConfig, norm_length: int = 0, teacher=None) -> torch.Tensor:
    theta = batch.theta
    advs = ref_advantages([[e.sample.reward for e in eps] for eps in batch.episodes], cfg)
    episodes = [
        (e, a)
        for eps, aa in zip(batch.episodes, advs, strict=True)
        for e, a in zip(eps, aa, strict=True)
    ]
    total_tokens = sum(len(p) for e, _ in episodes for p in e.segments)
    n_seq = sum(1 for e, _ in episodes if any(e.segments))
    loss = theta.new_zeros(())
    for ep, adv in episodes:
        length = sum(len(p) for p in ep.segments)
        if cfg.aggregation == "token_mean":  # DAPO (Yu et al. 2025)
            weight = 1 / total_tokens
        elif cfg.aggregation == "seq_mean":
            weight = 1 / (length * n_seq) if length else 0.0
        else:  # Dr. GRPO (Liu et al. 2025): a constant in place of each |o_i|
            weight = 1 / (norm_length * n_seq)
        for positions in ep.segments:
            if positions:
                ids = [ep.sample.response_ids[p] for p in positions]
                loss = (
                    loss + weight * ref_segment(theta, batch.behavior, ids, adv, cfg, teacher).sum()
                )
    return loss


def ref_segment(theta, behavior, ids, adv, cfg: LossConfig, teacher=None) -> torch.Tensor:
    """Per-token losses of one segment's trained tokens."""
    logp = theta[ids]
    b = torch.tensor([behavior[i] for i in ids], dtype=torch.float64)
    adv = torch.as_tensor(adv, dtype=torch.float64).expand(len(ids))
    if teacher is not None:  # on-policy distillation: reward -(log pi_b - log q) per token
        adv = cfg.rl_coef * adv + cfg.distill_coef * (teacher[ids] - b)
    base = b if cfg.ratio_base == "behavior" else logp.detach()
    if cfg.ratio == "token":
        r = torch.exp(logp - base)
    else:  # GSPO (Zheng et al. 2025): s_i = (pi(y_i|x) / pi_old(y_i|x)) ** (1 / |y_i|)
        s = torch.exp((logp.sum() - base.sum()) / len(ids))
        r = (
            s.expand(len(ids))
            if cfg.ratio == "sequence"
            else s.detach() * torch.exp(logp - logp.detach())
        )
    if cfg.kind == "cispo":  # MiniMax-M1 (2025): -sg(clip(r, 1 - e_low, 1 + e_high)) A log pi
        w = torch.clamp(r.detach(), 1 - cfg.cispo_eps_low, 1 + cfg.cispo_eps_high)
        per = -w * adv * logp
    else:  # PPO (Schulman et al. 2017), dual clip (Ye et al. 2020)
        per = -torch.minimum(r * adv, torch.clamp(r, 1 - cfg.eps_low, 1 + cfg.eps_high) * adv)
        if cfg.dual_clip is not None:
            per = torch.where(adv < 0, torch.minimum(per, -cfg.dual_clip * adv), per)
    if cfg.ratio_base == "proximal":  # decoupled PPO (Hilton et al. 2022), truncated IS
        iw = torch.exp(logp.detach() - b)
        per = per * (iw.clamp(max=cfg.tis_cap) if cfg.tis_cap else iw)
    if cfg.is_mask != "none":  # IcePop: drop tokens (sequences) with weight outside [low, high]
        lw = logp.detach() - b
        w = torch.exp(lw) if cfg.is_mask == "token" else torch.exp(lw.mean()).expand(len(ids))
        per = per * ((w >= cfg.is_mask_low) & (w <= cfg.is_mask_high))
    return per


# ---- the trainer's path in float64 --------------------------------------------------------


def trainer_loss(batch: Batch, cfg: LossConfig, packing: str, budget: int = 24, teacher=None):
    seqs = [s for s in build_sequences(batch.groups, cfg) if s.response_ids]
    loss = batch.theta.new_zeros(())
    totals = StepTotals()
    for mb in micro_batches(seqs, budget, packing, 0, "cpu", dtype=torch.float64):
        logp = batch.theta[mb.targets]  # each token's logp, by its unique id
        q = teacher[mb.targets] if teacher is not None else None
        part, terms = objective(
            logp,
            mb.behavior_logp,
            mb.advantages,
            mb.weights,
            cfg,
            spans=Spans.of(mb),
            teacher_logp=q,
        )
        loss = loss + part
        totals.add(mb, part.detach(), terms, logp.detach(), torch.zeros_like(logp), None)
    return loss, totals


def _assert_same(batch: Batch, cfg: LossConfig, packing: str, norm_length: int = 0):
    got, totals = trainer_loss(batch, cfg, packing)
    (grad,) = torch.autograd.grad(got, batch.theta)
    want = ref_loss(batch, cfg, norm_length)
    (want_grad,) = torch.autograd.grad(want, batch.theta)
    got, want = float(got.detach()), float(want.detach())
    assert abs(got - want) < TOL, (got, want)
    assert float((grad - want_grad).abs().max()) < TOL
    assert float(want_grad.abs().max()) > 1e-3  # not a vacuous comparison
    observed = [
        tid for eps in batch.episodes for e in eps
        for tid, o in zip(e.sample.response_ids, e.sample.observed, strict=True) if o
    ]  # fmt: skip
    assert observed and not grad[observed].any()  # observations are context, never trained
    return totals


OBJECTIVES = {
    "grpo": LossConfig(),
    "dr_grpo_no_std": LossConfig(normalize_std=False, aggregation="seq_mean"),
    "dual_clip": LossConfig(dual_clip=1.5),
    "gspo": LossConfig(ratio="sequence", aggregation="seq_mean", eps_low=3e-2, eps_high=4e-2),
    "gspo_token": LossConfig(ratio="sequence_token", eps_low=3e-2, eps_high=4e-2),
    "gspo_proximal": LossConfig(ratio="sequence", ratio_base="proximal", tis_cap=1.5),
    "cispo": LossConfig(kind="cispo", cispo_eps_low=0.3, cispo_eps_high=0.2),
    "cispo_no_floor": LossConfig(kind="cispo"),
    "cispo_sequence": LossConfig(kind="cispo", ratio="sequence", cispo_eps_high=0.1),
    "rloo": LossConfig(advantage="rloo"),
    "reinforce_pp": LossConfig(advantage="reinforce_pp", aggregation="seq_mean"),
    "is_mask_token": LossConfig(is_mask="token", is_mask_low=0.7, is_mask_high=1.4),
    "is_mask_sequence": LossConfig(is_mask="sequence", is_mask_low=0.85, is_mask_high=1.2),
    "is_mask_proximal_tis": LossConfig(
        ratio_base="proximal", tis_cap=1.3, is_mask="token", is_mask_low=0.6, is_mask_high=1.6
    ),
}


@pytest.mark.parametrize("packing", ["padded", "shared_prompt"])
@pytest.mark.parametrize("name", sorted(OBJECTIVES))
@pytest.mark.parametrize("seed", [0, 1])
def test_objective_equals_its_reference(name, packing, seed):
    _assert_same(Batch(seed), OBJECTIVES[name], packing)


@pytest.mark.parametrize("packing", ["padded", "shared_prompt"])
def test_dr_grpo_constant_normaliser_equals_its_reference(packing):
    cfg = LossConfig(aggregation="seq_sum_norm", normalize_std=False, norm_length=12)
    _assert_same(Batch(2), cfg, packing, norm_length=12)
    capped = LossConfig(aggregation="seq_sum_norm", response_cap=9)  # the cap by default
    _assert_same(Batch(3), capped, packing, norm_length=9)


def test_seq_sum_norm_does_not_divide_by_each_length():
    # Every token of every sequence, short or long: 1 / (norm_length * samples).
    batch = Batch(4)
    cfg = LossConfig(aggregation="seq_sum_norm", norm_length=4)
    seqs = build_sequences(batch.groups, cfg)
    samples = sum(len(g.samples) for g in batch.groups)
    assert {len(s.response_ids) for s in seqs} >= {1}
    assert {s.weight for s in seqs if s.trained_tokens} == {1 / (4 * samples)}


def test_sequence_ratio_is_one_value_per_segment_and_clipped_whole():
    batch = Batch(5)
    cfg = LossConfig(ratio="sequence", eps_low=1e-3, eps_high=1e-3)
    seqs = [s for s in build_sequences(batch.groups, cfg) if s.response_ids]
    (mb,) = micro_batches(seqs, 10_000, "padded", 0, "cpu", dtype=torch.float64)
    logp = batch.theta[mb.targets]
    _, terms = objective(logp, mb.behavior_logp, mb.advantages, mb.weights, cfg, spans=Spans.of(mb))
    for r, seq in enumerate(mb.sequences):
        row = terms.ratio[r][mb.mask[r]]
        if row.numel():
            assert torch.all(row == row[0])  # one ratio for the segment's trained tokens
            clipped = (terms.clipped_low[r] | terms.clipped_high[r])[mb.mask[r]]
            assert clipped.all() or not clipped.any() or seq.advantage == 0


def test_metrics_name_masked_share_and_sequence_ratios():
    batch = Batch(6)
    cfg = LossConfig(ratio="sequence", is_mask="token", is_mask_low=0.7, is_mask_high=1.4)
    _, totals = trainer_loss(batch, cfg, "shared_prompt")
    out = totals.summary()
    weights = [math.exp(float(batch.theta[t].detach()) - b) for t, b in batch.behavior.items()]
    want_masked = sum(not 0.7 <= w <= 1.4 for w in weights) / len(weights)
    assert out["is_masked_frac"] == pytest.approx(want_masked)
    assert 0 < out["is_masked_frac"] < 1
    assert out["seq_ratio_min"] <= out["seq_ratio_mean"] <= out["seq_ratio_max"]
    assert "is_masked_frac" not in trainer_loss(batch, LossConfig(), "padded")[1].summary()


def test_gspo_token_equals_gspo_under_per_sequence_advantages():
    batch = Batch(7)
    gspo = LossConfig(ratio="sequence", eps_low=0.05, eps_high=0.05)
    token = LossConfig(ratio="sequence_token", eps_low=0.05, eps_high=0.05)
    (g1,) = torch.autograd.grad(trainer_loss(batch, gspo, "padded")[0], batch.theta)
    (g2,) = torch.autograd.grad(trainer_loss(batch, token, "padded")[0], batch.theta)
    assert float((g1 - g2).abs().max()) < TOL


@pytest.mark.parametrize("advantage", ["grpo", "rloo"])
def test_all_equal_groups_and_groups_of_one_add_no_gradient(advantage):
    batch = Batch(8)
    cfg = LossConfig(advantage=advantage, ratio="sequence", kind="cispo")
    (grad,) = torch.autograd.grad(trainer_loss(batch, cfg, "shared_prompt")[0], batch.theta)
    flat = [e.sample for g in (1, 3) for e in batch.episodes[g]]  # rewards all 1, and one 0.5
    assert not grad[[t for s in flat for t in s.response_ids]].any()
    assert grad.abs().max() > 1e-3


@pytest.mark.parametrize("packing", ["padded", "shared_prompt"])
@pytest.mark.parametrize(
    "cfg",
    [
        LossConfig(distill_coef=1.0, rl_coef=0.0),  # distillation alone
        LossConfig(distill_coef=0.3, ratio="sequence", aggregation="seq_mean"),  # beside GSPO
        LossConfig(distill_coef=0.5, kind="cispo", is_mask="token", dual_clip=None),
    ],
)
def test_distillation_equals_its_reference(cfg, packing):
    """On-policy distillation (GKD, Agarwal et al. 2024): the per-token reward is minus the
    sampled token's reverse KL to the teacher, log q(y_t) - log pi_b(y_t)."""
    batch = Batch(9)
    gen = torch.Generator().manual_seed(9)
    teacher = batch.theta.detach() + 0.5 * torch.randn(
        batch.theta.shape, generator=gen, dtype=torch.float64
    )
    got, _ = trainer_loss(batch, cfg, packing, teacher=teacher)
    want = ref_loss(batch, cfg, teacher=teacher)
    (grad,) = torch.autograd.grad(got, batch.theta)
    (want_grad,) = torch.autograd.grad(want, batch.theta)
    assert abs(float(got.detach()) - float(want.detach())) < TOL
    assert float((grad - want_grad).abs().max()) < TOL
    assert float(want_grad.abs().max()) > 1e-3
