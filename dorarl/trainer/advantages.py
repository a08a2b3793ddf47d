"""Advantages from rewards: GRPO's group-relative ones, RLOO's leave-one-out baseline or
REINFORCE++'s batch normalisation, after DAPO's soft overlong punishment when it is on.

Invariants: advantages of a group (of the batch, for reinforce_pp) sum to zero; a group
whose rewards are all equal (or a group of one) has advantage 0 everywhere, so it adds no
policy gradient. The overlong
penalty is 0 up to `cap - buffer` response tokens and falls linearly to -1 at the cap.
"""

from __future__ import annotations

import math


def group_advantages(
    rewards: list[float], normalize_std: bool = True, eps: float = 1e-6
) -> list[float]:
    """A_i = (r_i - mean r) / (std r + eps), std being the unbiased sample std (as in TRL, verl).

    With `normalize_std=False`, A_i = r_i - mean r (Dr. GRPO).
    """
    if eps < 0.0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    n = len(rewards)
    if n == 0:
        return []
    # Compare the rewards themselves, not the centred ones: the rounded mean of equal
    # rewards can differ from them by an ulp, and that ulp divided by a ~0 std is O(1).
    if n == 1 or all(r == rewards[0] for r in rewards):
        return [0.0] * n
    mean = sum(rewards) / n
    centered = [r - mean for r in rewards]
    if not normalize_std:
        return centered
    std = math.sqrt(sum(c * c for c in centered) / (n - 1))
    return [c / (std + eps) for c in centered]


def rloo_advantages(rewards: list[float]) -> list[float]:
    """A_i = r_i - mean of the other rewards of the group = n / (n - 1) * (r_i - mean r)."""
    n = len(rewards)
    if n <= 1 or all(r == rewards[0] for r in rewards):
        return [0.0] * n
    total = sum(rewards)
    return [r - (total - r) / (n - 1) for r in rewards]


def batch_normalized(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """REINFORCE++: (r_i - mean r) / (std r + eps) over the whole batch (unbiased std)."""
    n = len(rewards)
    if n <= 1 or all(r == rewards[0] for r in rewards):
        return [0.0] * n
    mean = sum(rewards) / n
    centered = [r - mean for r in rewards]
    std = math.sqrt(sum(c * c for c in centered) / (n - 1))
    return [c / (std + eps) for c in centered]


def step_advantages(
    rewards: list[list[float]], method: str, normalize_std: bool = True, eps: float = 1e-6
) -> list[list[float]]:
    """Advantages of a step's groups (`rewards` per group) by `method` (LossConfig.advantage)."""
    if method == "grpo":
        return [group_advantages(r, normalize_std, eps) for r in rewards]
    if method == "rloo":
        return [rloo_advantages(r) for r in rewards]
    if method == "reinforce_pp":
        flat = iter(batch_normalized([r for group in rewards for r in group], eps))
        return [[next(flat) for _ in group] for group in rewards]
    raise ValueError(f"unknown advantage {method!r}")


def overlong_penalty(length: int, cap: int, buffer: int) -> float:
    """DAPO's soft overlong punishment of a response of `length` tokens under a `cap`: 0 up
    to cap - buffer, then -1/buffer per token, -1 at the cap (and beyond)."""
    if buffer < 1 or buffer >= cap:
        raise ValueError(f"overlong buffer {buffer} must be in [1, cap {cap})")
    return max(-1.0, min(0.0, (cap - buffer - length) / buffer))
