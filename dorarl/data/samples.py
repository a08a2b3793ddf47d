"""Samples and groups: one sampled response, and a prompt with its G responses.

Torch-free on purpose: the controller, the simulator and the Ray runtime pass these
around, and they must pickle cheaply. Invariant: a `Sample` carries one behavior
version per response token, so mixed-version (partial rollout) trajectories need no
special case downstream.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sample:
    """One response of a group, as sampled by the rollout engines."""

    group_id: int
    sample_index: int
    prompt_id: int
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    reward: float = 0.0
    reward_error: str | None = None
    migrations: int = 0
    offloads: int = 0
    # Multi-turn: per response token, True for an environment's observation (context the
    # loss masks out, logprob 0); empty for a single-turn sample. `turns` holds, per turn,
    # (sampled tokens, observation tokens after it).
    observed: list[bool] = field(default_factory=list)
    turns: list[tuple[int, int]] = field(default_factory=list)

    @property
    def behavior_version(self) -> int:
        """The oldest version that sampled any token (the version of a one-version sample)."""
        return min(self.versions) if self.versions else -1

    @property
    def single_version(self) -> bool:
        return len(set(self.versions)) <= 1


@dataclass
class Group:
    """A prompt with its G responses: the unit of dispatch, versioning and advantages."""

    group_id: int
    prompt_id: int
    version: int
    samples: list[Sample] = field(default_factory=list)

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    @property
    def response_tokens(self) -> int:
        return sum(len(s.response_ids) for s in self.samples)
