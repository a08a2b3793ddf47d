"""Batch statistics for one training step: rewards, lengths, staleness, reward and tool errors.

Staleness of a sample consumed by the step that updates version v is v - w, w being its
behavior version (the oldest version among its tokens; Eq. 1 of docs/design.md).
"""

from __future__ import annotations

import statistics
from collections import Counter

from dorarl.data import Group


def batch_metrics(groups: list[Group], train_version: int) -> dict[str, float | dict]:
    samples = [s for g in groups for s in g.samples]
    rewards = [s.reward for s in samples]
    lengths = [len(s.response_ids) for s in samples]
    staleness = [train_version - _behavior_version(s, g) for g in groups for s in g.samples]
    return {
        "groups": float(len(groups)),
        "samples": float(len(samples)),
        "reward_mean": statistics.fmean(rewards) if rewards else 0.0,
        "reward_std": statistics.pstdev(rewards) if rewards else 0.0,
        "reward_errors": float(sum(s.reward_error is not None for s in samples)),
        "response_len_mean": statistics.fmean(lengths) if lengths else 0.0,
        "response_len_max": float(max(lengths, default=0)),
        "truncated_fraction": _fraction(s.truncated for s in samples),
        # Chat episodes: tool calls the replies attempted, and those answered with an error.
        "tool_calls": float(sum(t.tool_calls for s in samples for t in s.turns)),
        "tool_call_errors": float(sum(t.tool_errors for s in samples for t in s.turns)),
        # The share of episodes whose replies attempted a call (0 for single-turn samples).
        "tool_use": _fraction(any(t.tool_calls for t in s.turns) for s in samples),
        # Agents' episodes: segments opened by calls that did not extend the conversation.
        "new_segments": float(sum(len(s.segments) for s in samples)),
        "zero_advantage_groups": _fraction(len(set(g.rewards)) <= 1 for g in groups),
        "mixed_version_samples": float(sum(not s.single_version for s in samples)),
        "staleness_mean": statistics.fmean(staleness) if staleness else 0.0,
        "staleness_max": float(max(staleness, default=0)),
        "staleness_hist": dict(sorted(Counter(staleness).items())),
        "staleness_token_mean": _token_staleness(groups, train_version),
    }


def _token_staleness(groups: list[Group], train_version: int) -> float:
    """Mean of v - version over response tokens (differs from the sample view only for
    mixed-version, partial-rollout samples)."""
    gaps = [train_version - w for g in groups for s in g.samples for w in s.versions]
    return statistics.fmean(gaps) if gaps else 0.0


def _behavior_version(sample, group: Group) -> int:
    return sample.behavior_version if sample.versions else group.version


def _fraction(flags) -> float:
    flags = list(flags)
    return sum(flags) / len(flags) if flags else 0.0
