"""The trainer's log-probs against the engines' on one step's trained tokens: mean |gap| and
the importance ratio's tails, over all tokens and over fresh ones (sampled by the version trained).

A fresh token's ratio pi_trainer / pi_behavior is 1 up to numerics (kernels, dtypes), so its
figures measure the engine/trainer mismatch alone; over all tokens they add the policy's drift.
Percentiles are exact: every token's log-ratio is kept (8 bytes a token; one gather over ranks
per step), which a fixed histogram would give only to its bin width, near 1 for fresh tokens
and over many orders of magnitude for stale ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

PERCENTILES = (1, 99)


@dataclass
class Mismatch:
    """Per trained token, logp_trainer - logp_behavior and whether the token is fresh,
    as (tokens, 2) float64 chunks (one per micro-batch)."""

    chunks: list[torch.Tensor] = field(default_factory=list)

    def add(self, log_ratio: torch.Tensor, fresh: torch.Tensor) -> None:
        self.chunks.append(torch.stack([log_ratio.double(), fresh.double()], dim=1))

    def values(self) -> torch.Tensor:
        if not self.chunks:
            return torch.zeros((0, 2), dtype=torch.float64)
        return torch.cat(self.chunks)

    def gathered(self, gather: Callable[[torch.Tensor], torch.Tensor]) -> Mismatch:
        """Every rank's tokens (`gather` concatenates a tensor over ranks)."""
        return Mismatch([gather(self.values())])

    def summary(self) -> dict[str, float]:
        values = self.values()
        log_ratio, fresh = values[:, 0], values[:, 1] > 0.5
        out = {"rollout_fresh_tokens": float(fresh.sum())}
        return out | _figures(log_ratio, "") | _figures(log_ratio[fresh], "_fresh")


def _figures(log_ratio: torch.Tensor, suffix: str) -> dict[str, float]:
    """Mean |log-ratio| and the ratio's percentiles ({} without tokens)."""
    if not log_ratio.numel():
        return {}
    ratio = torch.sort(torch.exp(log_ratio.double())).values
    out = {f"rollout_logp_abs_diff{suffix}": float(log_ratio.abs().mean())}
    for q in PERCENTILES:
        out[f"rollout_ratio_p{q}{suffix}"] = percentile(ratio, q)
    return out


def percentile(ordered: torch.Tensor, q: float) -> float:
    """The q-th percentile of ascending `ordered`, linear between neighbours (numpy's default)."""
    at = q / 100 * (ordered.numel() - 1)
    low = int(at)
    high = min(low + 1, ordered.numel() - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (at - low))
