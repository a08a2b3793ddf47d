"""Samples and groups: one sampled response, and a prompt with its G responses.

Torch-free on purpose: the controller, the simulator and the Ray runtime pass these
around, and they must pickle cheaply. Invariant: a `Sample` carries one behavior
version per response token, so mixed-version (partial rollout) trajectories need no
special case downstream. An episode of several segments (an agent's call that did not
extend its conversation opened a fresh context) is one flat response whose later segments'
prompts sit in it as observed tokens; `Sample.segments` says where each begins, and the
trainer gives each segment a context of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Turn:
    """One turn of a multi-turn episode: the tokens sampled, how its sampling ended (the
    engine's caps count per turn), the observation tokens the environment added after it,
    the tool calls its reply attempted and those answered with an error (malformed, of an
    unknown tool, cut by the length cap, or refused by the tool with `ToolError`)."""

    sampled: int
    observed: int
    finish_reason: str  # "stop" | "stop_string" | "length"
    tool_calls: int = 0
    tool_errors: int = 0


@dataclass(frozen=True)
class SegmentStart:
    """Where a later segment of an episode begins in its response: at index `at`, its fresh
    prompt of `prompt` tokens (observed), then its turns. A segment's tokens attend to
    nothing before `at`: its KV was computed from its own prompt."""

    at: int
    prompt: int


class NewSegment(list[int]):
    """Prompt ids that open a new segment of an episode (a fresh context, prefilled from
    scratch under the episode's version), where plain ids extend the current one. An
    episode source returns it in place of observation ids."""


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
    # A user's rewards: each named part's value, unweighted (empty for a built-in reward);
    # with a reward model, its score (`reward_model`) and the verifier's reward (`verifier`).
    reward_parts: dict[str, float] = field(default_factory=dict)
    # Notes on how it scored (the code task's first failed test), written to its trajectory row.
    reward_info: dict[str, str] = field(default_factory=dict)
    migrations: int = 0
    offloads: int = 0
    # Multi-turn: per response token, True for an environment's observation (context the
    # loss masks out, logprob 0); `turns`, one per turn. Both empty for a single-turn sample.
    observed: list[bool] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    # MoE with engine.record_routes: per response token, the expert ids each sparse layer
    # chose when the engine sampled it (dorarl.data.routes); empty when not recorded.
    routes: bytes = b""
    # An episode's segments after its first, in order; empty for one segment (every
    # single-turn sample, every Env's episode).
    segments: list[SegmentStart] = field(default_factory=list)

    @property
    def behavior_version(self) -> int:
        """The oldest version that sampled any token (the version of a one-version sample)."""
        return min(self.versions) if self.versions else -1

    @property
    def single_version(self) -> bool:
        return len(set(self.versions)) <= 1

    @property
    def turn_lengths(self) -> list[int]:
        """Sampled tokens per turn, what the engines' length cap bounds (one for a
        single-turn sample: its whole response)."""
        return [t.sampled for t in self.turns] if self.turns else [len(self.response_ids)]

    @property
    def num_segments(self) -> int:
        return 1 + len(self.segments)

    @property
    def truncated(self) -> bool:
        """Some turn was cut by the length cap, not only possibly the last."""
        if self.turns:
            return any(t.finish_reason == "length" for t in self.turns)
        return self.finish_reason == "length"


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
