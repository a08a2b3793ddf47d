"""Per-request sampling with a counter-based random stream and exact logprobs.

Randomness: the uniform draw for a request's n-th output token is a pure hash of
(seed, n), so a request samples the same tokens on any engine, in any batch, after any
number of migrations; its "RNG state" is just its seed and output length. A token is drawn
by inverting the CDF of its row's final distribution (vocab order when unfiltered, sorted
order when top-k/top-p filter), so each row's result depends on that row alone.

Logprobs: for temperature > 0 the logprob is under the full softmax of logits / T, also when
top-k / top-p restrict the set a token is drawn from. That is the policy the trainer
computes, so fresh on-policy data has importance ratio exactly 1; the filtered,
renormalised distribution would put the behaviour logprob above the trainer's and every
ratio below 1. For greedy (T = 0) it is the logprob under the unmodified softmax, i.e. the
model's own probability of the argmax token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dorarl.engine.config import SamplingParams

_M32 = 0xFFFFFFFF


def _mul32(x: int, c: int) -> int:
    return (x * c) & _M32


def _mix32(x: int) -> int:
    """A 32-bit integer hash with good avalanche (lowbias32)."""
    x ^= x >> 16
    x = _mul32(x, 0x7FEB352D)
    x ^= x >> 15
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform(seed: int, counter: int) -> float:
    """A uniform draw in (0, 1) from (seed, counter), identical on every machine."""
    h = _mix32((counter * 0x9E3779B9 + 0x632BE5AB) & _M32)
    h = _mix32(h ^ (seed & _M32))
    h = _mix32(h ^ ((seed >> 32) & _M32))
    lo = _mix32(h ^ 0x5BD1E995)
    # 53 bits from two words, then shifted off 0 so log/inverse-CDF never see an endpoint.
    bits = (h << 21) ^ (lo >> 11)
    return (bits + 0.5) / float(1 << 53)


@dataclass
class SampleRow:
    params: SamplingParams
    seed: int
    counter: int  # output tokens already sampled by this request


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[float]]:
    """Tokens and their logprobs for logits `[rows, vocab]` (float32)."""
    greedy, plain, filtered = [], [], []
    for i, row in enumerate(rows):
        p = row.params
        (greedy if p.greedy else filtered if p.filtered else plain).append(i)
    kinds = ((greedy, _greedy), (plain, _plain), (filtered, _filtered))
    for idx, fn in kinds:
        if len(idx) == len(rows):  # one kind of row: no copy of the logits into groups
            tok, lp = fn(logits, rows)
            return tok.tolist(), lp.tolist()
    tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    logprobs = torch.empty(len(rows), dtype=torch.float32, device=logits.device)
    for idx, fn in kinds:
        if idx:
            index = torch.tensor(idx, device=logits.device)
            tok, lp = fn(logits.index_select(0, index), [rows[i] for i in idx])
            tokens.index_copy_(0, index, tok)
            logprobs.index_copy_(0, index, lp)
    return tokens.tolist(), logprobs.tolist()


def _greedy(logits: torch.Tensor, rows: list[SampleRow]) -> tuple[torch.Tensor, torch.Tensor]:
    tok = first_argmax(logits)
    lp = torch.log_softmax(logits, dim=-1).gather(1, tok[:, None]).squeeze(1)
    return tok, lp


def first_argmax(logits: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """`logits.argmax(-1)` (the first maximal index per row), found as the first chunk holding
    the row's max, then the first max in it: a vectorised max over the vocabulary and two small
    argmaxes instead of one index-tracking pass (10x faster on CPU at a 49k vocabulary)."""
    rows, vocab = logits.shape
    whole = vocab // chunk * chunk
    if not whole or logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    chunks = logits[:, :whole].unflatten(1, (-1, chunk))  # a view: rows stay contiguous
    which = chunks.amax(dim=-1).argmax(dim=-1)
    best = which * chunk + chunks[torch.arange(rows), which].argmax(dim=-1)
    if whole == vocab:
        return best
    tail = logits[:, whole:]
    tail_best = tail.argmax(dim=-1)
    later = tail.gather(1, tail_best[:, None]) > logits.gather(1, best[:, None])
    return torch.where(later.squeeze(1), whole + tail_best, best)


def _scaled_logprobs(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    temps = [r.params.temperature for r in rows]
    if any(t != 1.0 for t in temps):
        logits = logits / torch.tensor(temps, device=logits.device)[:, None]
    return torch.log_softmax(logits, dim=-1)


def _draws(rows: list[SampleRow], device: torch.device) -> torch.Tensor:
    return torch.tensor(
        [uniform(r.seed, r.counter) for r in rows], dtype=torch.float64, device=device
    )


def _invert(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index of the first cdf entry >= u * total, per row (never a zero-mass entry)."""
    total = cdf[:, -1:]
    # Rounding may push the target past the total; capped, it lands on the last nonzero entry.
    target = torch.minimum((u[:, None] * total.double()).to(cdf.dtype), total)
    return torch.searchsorted(cdf, target).squeeze(1)


def _plain(logits: torch.Tensor, rows: list[SampleRow]) -> tuple[torch.Tensor, torch.Tensor]:
    logp = _scaled_logprobs(logits, rows)
    # float32 cumsum: a per-row scan, so a row's draw is still independent of its batch.
    cdf = logp.exp().cumsum_(dim=-1)
    tok = _invert(cdf, _draws(rows, logits.device))
    return tok, logp.gather(1, tok[:, None]).squeeze(1)


def _filtered(logits: torch.Tensor, rows: list[SampleRow]) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw from temperature, then top-k, then top-p on the renormalised top-k mass (HF/vLLM
    order); the logprob is the token's under the temperature-scaled softmax alone."""
    logp = _scaled_logprobs(logits, rows)
    sorted_logp, order = logp.sort(dim=-1, descending=True, stable=True)
    probs = sorted_logp.double().exp()
    keep = _top_k_mask(rows, probs)
    probs = probs * keep
    top_p = torch.tensor([r.params.top_p for r in rows], dtype=torch.float64, device=logits.device)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    keep &= mass_before < top_p[:, None] * probs.sum(dim=-1, keepdim=True)
    kept = probs * keep
    cdf = kept.cumsum(dim=-1)
    pos = _invert(cdf, _draws(rows, logits.device))
    tok = order.gather(1, pos[:, None]).squeeze(1)
    # Under the full tempered softmax, not the renormalised kept set (module docstring).
    return tok, sorted_logp.gather(1, pos[:, None]).squeeze(1)


def _top_k_mask(rows: list[SampleRow], probs: torch.Tensor) -> torch.Tensor:
    vocab = probs.shape[1]
    ks = torch.tensor([r.params.top_k or vocab for r in rows], device=probs.device)
    return torch.arange(vocab, device=probs.device)[None, :] < ks[:, None]
