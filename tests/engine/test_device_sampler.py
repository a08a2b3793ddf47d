"""Batched device sampling: the CPU sampler's streams bit for bit, no dependence on companions,
the right distributions and sets, logprobs under the tempered softmax."""

from __future__ import annotations

import pytest
import torch

from dorarl.engine.config import SamplingParams
from dorarl.engine.device_sampler import fetch, sample_on_device, sampling_batch, uniforms
from dorarl.engine.sampler import SampleRow, sample, uniform

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=0.9, top_p=0.8),
    SamplingParams(temperature=1.0, top_k=20, top_p=0.5),
    SamplingParams(temperature=0.0, top_p=0.3),  # greedy wins over filtering
]


def _draw(logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[float]]:
    batch = sampling_batch(rows, logits.shape[1], DEVICE)
    return fetch(*sample_on_device(logits.to(DEVICE), batch))


def _logits(rows: int, vocab: int = 300, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * 3


def test_uniforms_are_the_cpu_samplers_stream_bit_for_bit():
    seeds = [0, 1, 7, 2**32 - 1, 2**32, 2**32 + 5, 2**62 + 12345, 2**63 - 1]
    counters = [0, 1, 2, 17, 1000, 2**31 + 3]
    pairs = [(s, c) for s in seeds for c in counters]
    lo = torch.tensor([s & 0xFFFFFFFF for s, _ in pairs], device=DEVICE)
    hi = torch.tensor([s >> 32 for s, _ in pairs], device=DEVICE)
    ctr = torch.tensor([c for _, c in pairs], device=DEVICE)
    ours = uniforms(lo, hi, ctr).tolist()
    assert ours == [uniform(s, c) for s, c in pairs]


@pytest.mark.skipif(DEVICE.type != "cpu", reason="bitwise equality is the CPU's arithmetic")
def test_equals_the_cpu_sampler_bit_for_bit_on_a_mixed_batch():
    rows = [
        SampleRow(MIXED[i % len(MIXED)], seed=1000 + i, counter=3 * i)
        for i in range(3 * len(MIXED))
    ]
    logits = _logits(len(rows))
    assert _draw(logits, rows) == sample(logits, rows)


def test_a_rows_draw_ignores_its_companions_and_its_place():
    logits = _logits(len(MIXED), seed=1)
    rows = [SampleRow(p, seed=50 + i, counter=i) for i, p in enumerate(MIXED)]
    together = _draw(logits, rows)
    for i in range(len(rows)):
        alone = _draw(logits[i : i + 1], rows[i : i + 1])
        assert (alone[0][0], alone[1][0]) == (together[0][i], together[1][i])
    order = list(reversed(range(len(rows))))
    flipped = _draw(logits[order], [rows[i] for i in order])
    assert flipped[0] == [together[0][i] for i in order]
    assert flipped[1] == [together[1][i] for i in order]


def test_greedy_is_the_argmax_with_its_plain_logprob():
    logits = _logits(6, seed=2)
    rows = [SampleRow(SamplingParams(temperature=0.0), seed=i, counter=i) for i in range(6)]
    tokens, logprobs = _draw(logits, rows)
    assert tokens == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])
    torch.testing.assert_close(torch.tensor(logprobs), expected.squeeze(1), atol=1e-6, rtol=0)


def test_logprobs_are_under_the_full_tempered_softmax_whatever_filters():
    logits = _logits(len(MIXED), seed=3)
    rows = [SampleRow(p, seed=9, counter=4) for p in MIXED]
    tokens, logprobs = _draw(logits, rows)
    temps = torch.tensor([p.temperature or 1.0 for p in MIXED])
    full = torch.log_softmax(logits / temps[:, None], -1)
    expected = full.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-6, rtol=0)


def _target(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution a token is drawn from: tempered, top-k, then top-p (HF/vLLM order)."""
    probs = torch.softmax(logits.double() / temperature, -1)
    sorted_p, order = probs.sort(descending=True, stable=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if top_k:
        keep[top_k:] = False
    kept = sorted_p * keep
    keep &= kept.cumsum(0) - kept < top_p * kept.sum()
    target = torch.zeros_like(probs)
    target[order[keep]] = sorted_p[keep]
    return target / target.sum()


def _chi2(counts: torch.Tensor, target: torch.Tensor, n: int) -> float:
    expected = target * n
    support = target > 0
    return (((counts - expected) ** 2) / expected.clamp(min=1e-12))[support].sum().item()


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (4, 1.0), (0, 0.7), (5, 0.8)])
def test_many_draws_follow_the_filtered_tempered_distribution(top_k, top_p):
    logits = torch.tensor([1.2, -0.3, 2.0, 0.4, 0.0, -1.0, 1.6, -2.5, 0.9, 0.2])
    temperature, n = 0.8, 8000
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    rows = [SampleRow(params, seed=321, counter=c) for c in range(n)]  # one request's stream
    tokens, _ = _draw(logits.repeat(n, 1), rows)
    counts = torch.bincount(torch.tensor(tokens), minlength=10).double()
    target = _target(logits, temperature, top_k, top_p)
    assert counts[target == 0].sum() == 0, "a token outside the top-k / top-p set was drawn"
    assert (counts[target > 0] > 0).all(), "a token of the set was never drawn"
    df = int((target > 0).sum()) - 1
    bound = df + 5 * (2 * df) ** 0.5 + 5  # chi2(df) mean + 5 sd: p < 1e-4 for a right sampler
    chi2 = _chi2(counts, target, n)
    assert chi2 < bound, f"chi2 {chi2:.1f} >= {bound:.1f} for {counts.tolist()}"
    # The same bound rejects a sampler that ignored the temperature (the test has power).
    wrong = _target(logits, 1.0, top_k, top_p)
    assert _chi2(counts, wrong, n) > bound


def test_top_k_and_top_p_sets_on_a_wide_vocabulary():
    logits = _logits(1, vocab=2000, seed=4)[0]
    n = 3000
    for params in (SamplingParams(top_k=7), SamplingParams(temperature=0.5, top_p=0.6)):
        rows = [SampleRow(params, seed=77, counter=c) for c in range(n)]
        tokens, _ = _draw(logits.repeat(n, 1), rows)
        allowed = _target(logits, params.temperature, params.top_k, params.top_p) > 0
        drawn = torch.zeros(2000, dtype=torch.bool)
        drawn[torch.tensor(tokens)] = True
        assert not (drawn & ~allowed).any()
        if params.top_k:
            assert drawn.sum() == 7  # every one of the 7 comes up in 3000 draws


@pytest.mark.cuda
def test_uploading_and_sampling_never_wait_for_the_device():
    logits = _logits(len(MIXED), seed=5).cuda()
    rows = [SampleRow(p, seed=3, counter=2) for p in MIXED]
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
    try:
        tokens, logprobs = sample_on_device(logits, sampling_batch(rows, 300, DEVICE))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert fetch(tokens, logprobs) == _draw(logits, rows)
