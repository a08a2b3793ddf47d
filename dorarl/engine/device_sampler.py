"""Sampling the whole batch on the device: tensor ops for every row at once, one host sync.

The same streams and arithmetic as `sampler.py`, batched: a row's uniform draw is the hash
of (its seed, its output tokens so far), computed here with torch integer ops (bit for bit
`sampler.uniform`), and it is inverted through the CDF of the row's own distribution (vocab
order unfiltered, sorted order when top-k / top-p filter). On the CPU the results equal
`sampler.sample` bit for bit; on any device a row's token depends on its logits, seed and
counter alone, never on its companions or its place in the batch, so a migrated request
continues the same stream on another engine. The logprob is the chosen token's under the
full softmax of logits / temperature (docs/training.md, "Sampling and the importance ratio");
greedy rows (temperature 0) take the argmax and its logprob under the plain softmax.

Wiring (`device_runner.DeviceRunner` with `engine.sampler=device`, cuda's default):
    rows = [SampleRow(s.params, s.seed, s.num_output) for s in seqs]   # sampler.SampleRow
    batch = sampling_batch(rows, vocab_size, device)
    tokens, logprobs = fetch(*sample_on_device(logits, batch))   # the step's one host sync
`sampling_batch` uploads every row's settings in one host-to-device copy (before the
forward, so it overlaps with it); `sample_on_device` queues kernels and never waits for the
device (no `.item()`, no data-dependent shapes: which rows filter is known on the host).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from dorarl.engine.config import SamplingParams

_M32 = 0xFFFFFFFF


class SampleRow(Protocol):
    """What a row to sample brings (`sampler.SampleRow` is one)."""

    params: SamplingParams
    seed: int
    counter: int  # output tokens the request has sampled so far


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x < 2**32, in 16-bit halves so nothing overflows int64."""
    lo = x & 0xFFFF
    hi = x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """`sampler._mix32` (lowbias32) on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniforms(seed_lo: torch.Tensor, seed_hi: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """`sampler.uniform(seed, counter)` for int64 tensors of the seed's 32-bit halves."""
    h = _mix32((_mul32(counter & _M32, 0x9E3779B9) + 0x632BE5AB) & _M32)
    h = _mix32(h ^ seed_lo)
    h = _mix32(h ^ seed_hi)
    lo = _mix32(h ^ 0x5BD1E995)
    bits = (h << 21) ^ (lo >> 11)  # 53 bits
    return (bits.double() + 0.5) / float(1 << 53)


@dataclass
class SamplingBatch:
    """Per-row settings of the rows to sample, on the device; `filtered_rows` from the host."""

    temperature: torch.Tensor  # [rows] float32; 1 on greedy rows (logits left unscaled)
    greedy: torch.Tensor  # [rows] bool
    top_p: torch.Tensor  # [rows] float64
    top_k: torch.Tensor  # [rows] int64; the vocabulary size where top_k is 0
    seed_lo: torch.Tensor  # [rows] int64, bits 0..31 of the seed
    seed_hi: torch.Tensor  # [rows] int64, bits 32..63
    counter: torch.Tensor  # [rows] int64, output tokens the request has sampled
    filtered_rows: torch.Tensor | None  # rows that top-k / top-p filter; None: no row does


_COLUMNS = ("temperature", "greedy", "top_p", "top_k", "seed_lo", "seed_hi", "counter")


def sampling_batch(rows: Sequence[SampleRow], vocab: int, device: torch.device) -> SamplingBatch:
    """Every row's settings in one upload (float64 holds each column exactly)."""
    filtered = [i for i, r in enumerate(rows) if not r.params.greedy and r.params.filtered]
    host = torch.tensor([_row_values(r, vocab) for r in rows], dtype=torch.float64)
    host = torch.cat([host.T.reshape(-1), torch.tensor(filtered, dtype=torch.float64)])
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    flat = host.to(device, non_blocking=True)
    cols = dict(
        zip(_COLUMNS, flat[: len(rows) * len(_COLUMNS)].view(len(_COLUMNS), -1), strict=True)
    )
    return SamplingBatch(
        temperature=cols["temperature"].float(),
        greedy=cols["greedy"].bool(),
        top_p=cols["top_p"],
        **{k: cols[k].long() for k in ("top_k", "seed_lo", "seed_hi", "counter")},
        filtered_rows=flat[len(rows) * len(_COLUMNS) :].long() if filtered else None,
    )


def _row_values(row: SampleRow, vocab: int) -> list[float]:
    p = row.params
    return [
        1.0 if p.greedy else p.temperature,
        float(p.greedy),
        p.top_p,
        float(p.top_k or vocab),
        float(row.seed & _M32),
        float((row.seed >> 32) & _M32),
        float(row.counter),
    ]


def sample_on_device(
    logits: torch.Tensor, batch: SamplingBatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens (int64) and their logprobs (float32) for logits `[rows, vocab]` (float32),
    left on the device; nothing here waits for it."""
    logp = torch.log_softmax(logits / batch.temperature[:, None], dim=-1)
    u = uniforms(batch.seed_lo, batch.seed_hi, batch.counter)
    tokens = _invert(logp.exp().cumsum_(dim=-1), u)
    if batch.filtered_rows is not None:
        idx = batch.filtered_rows
        tokens.index_copy_(0, idx, _filtered_tokens(logp.index_select(0, idx), batch, idx, u))
    tokens = torch.where(batch.greedy, logits.argmax(dim=-1), tokens)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def _invert(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index of the first cdf entry >= u * total, per row (`sampler._invert`)."""
    total = cdf[:, -1:]
    target = torch.minimum((u[:, None] * total.double()).to(cdf.dtype), total)
    return torch.searchsorted(cdf, target).squeeze(1)


def _filtered_tokens(
    logp: torch.Tensor, batch: SamplingBatch, idx: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """Top-k, then top-p on the renormalised top-k mass, in sorted order (`sampler._filtered`)."""
    sorted_logp, order = logp.sort(dim=-1, descending=True, stable=True)
    probs = sorted_logp.double().exp()
    ranks = torch.arange(logp.shape[1], device=logp.device)
    keep = ranks[None, :] < batch.top_k.index_select(0, idx)[:, None]
    probs = probs * keep
    mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    top_p = batch.top_p.index_select(0, idx)
    keep &= mass_before < top_p[:, None] * probs.sum(dim=-1, keepdim=True)
    pos = _invert((probs * keep).cumsum(dim=-1), u.index_select(0, idx))
    return order.gather(1, pos[:, None]).squeeze(1)


def fetch(tokens: torch.Tensor, logprobs: torch.Tensor) -> tuple[list[int], list[float]]:
    """The step's one host sync: tokens and logprobs to Python in a single copy."""
    both = torch.stack([tokens.double(), logprobs.double()]).cpu()  # both exact in float64
    return [int(t) for t in both[0].tolist()], both[1].tolist()
