"""Long-tailed response lengths: lognormal with a chosen median and p99/median ratio, and
the statistics every report gives of a set of lengths (`length_stats`).

Samples of one group share a per-group factor (their prompt makes them long or short
together); `group_corr` is the share of log-variance it carries, so the marginal stays
lognormal(median, sigma) for any correlation. Lengths of group g depend only on
(seed, g): the same group gets the same lengths whatever the schedule.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from dorarl.config import ConfigError, check_fields

Z99 = 2.3263478740408408  # standard normal 99th percentile


@dataclass(kw_only=True)
class LengthDist:
    median: float = field(
        default=512.0, metadata={"help": "median response length (tokens)", "ge": 1}
    )
    p99_ratio: float = field(
        default=12.0, metadata={"help": "p99 / median of response lengths", "ge": 1}
    )
    group_corr: float = field(
        default=0.5, metadata={"help": "share of log-variance shared in a group", "ge": 0, "le": 1}
    )
    min_len: int = field(default=1, metadata={"help": "shortest response", "ge": 1})
    max_len: int = field(default=16384, metadata={"help": "longest response (cap)", "ge": 1})
    prompt_len: int = field(default=256, metadata={"help": "prompt tokens per group", "ge": 1})

    def validate(self) -> None:
        check_fields(self)
        if self.min_len > self.max_len:
            raise ConfigError(
                f"max_len: need min_len <= max_len, got {self.min_len}, {self.max_len}"
            )

    @property
    def sigma(self) -> float:
        return math.log(self.p99_ratio) / Z99

    def group_lengths(self, seed: int, group_id: int, group_size: int) -> list[int]:
        """Forced response lengths of the G samples of group `group_id`."""
        import numpy as np  # here, so configs that name a LengthDist load without numpy

        rng = np.random.default_rng([seed, group_id])
        shared = rng.standard_normal()
        own = rng.standard_normal(group_size)
        z = math.sqrt(self.group_corr) * shared + math.sqrt(1.0 - self.group_corr) * own
        lengths = np.rint(self.median * np.exp(self.sigma * z))
        return [int(n) for n in np.clip(lengths, self.min_len, self.max_len)]


def fit_lognormal(mean: float, p99: float, **kwargs) -> LengthDist:
    """The lognormal whose mean and 99th percentile (before the cap) are `mean` and `p99`.

    With median m and sigma s: mean = m exp(s^2 / 2) and p99 = m exp(Z99 s), so
    ln(p99 / mean) = Z99 s - s^2 / 2; we take the smaller root (the one with p99 > median).
    """
    if not p99 > mean > 0:
        raise ConfigError(f"p99: need p99 > mean > 0, got mean={mean}, p99={p99}")
    c = math.log(p99 / mean)
    disc = Z99 * Z99 - 2.0 * c
    if disc < 0:
        raise ConfigError(f"p99: no lognormal has mean {mean} and p99 {p99}")
    sigma = Z99 - math.sqrt(disc)
    median = mean / math.exp(sigma * sigma / 2.0)
    return LengthDist(median=median, p99_ratio=p99 / median, **kwargs)


def dapo_qwen32b() -> LengthDist:
    """Response lengths of DAPO on Qwen2.5-32B (Yu et al. 2025, arXiv:2503.14476, Fig. 7/8).

    Published: mean response length rises during training and settles around 4-6k tokens;
    responses are capped at 20,480 (16k + a 4k overlong buffer); prompts are AIME-style math
    (~200 tokens with the template). We fit mean 5,000 with the 99th percentile at the cap,
    i.e. about 1% of responses run to the limit; 16 samples of one prompt share half their
    log-variance.
    """
    return fit_lognormal(5000.0, 20480.0, group_corr=0.5, max_len=20480, prompt_len=256)


def percentile(lengths: Sequence[int], share: float) -> int:
    """The nearest-rank percentile: the smallest length with at least `share` of all at or
    below it (always a length that occurred; no interpolation)."""
    ordered = sorted(lengths)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


def length_stats(lengths: Sequence[int]) -> dict[str, float]:
    """Count, median, mean, p90, p99 (nearest rank), max and the p99 / median tail ratio."""
    if not lengths:
        raise ValueError("length_stats: no lengths")
    median = float(statistics.median(lengths))
    p99 = float(percentile(lengths, 0.99))
    return {
        "n": len(lengths),
        "median": median,
        "mean": statistics.fmean(lengths),
        "p90": float(percentile(lengths, 0.90)),
        "p99": p99,
        "max": float(max(lengths)),
        "p99_over_median": p99 / median if median else 0.0,
    }
